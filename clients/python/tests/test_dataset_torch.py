"""ckptd.torch.CkptdIterableDataset under torch's DataLoader, workers included."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from slow import scaled
from torch.utils.data import DataLoader, default_collate
from wds import write_shards

import ckptd
import ckptd.torch
from ckptd.torch import Batch, BatchDict, CkptdIterableDataset

SHARDS, PER, BATCH = 7, 20, 8

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*pin_memory.*:UserWarning",  # a CPU-only machine has nothing to pin into
    "ignore:.*worker.*:UserWarning",  # more workers than this machine's CPUs
)


@pytest.fixture
def data(tmp_path):
    return tmp_path / "data", write_shards(tmp_path / "data", SHARDS, PER)


def to_tensors(sample: dict) -> dict:
    """A decode step, as a trainer's would be: bytes to tensors."""
    return {
        "label": torch.tensor(int(sample["cls"])),
        "length": torch.tensor(len(sample["txt"])),
        "key": sample["__key__"],
    }


def loader(ds: CkptdIterableDataset, workers: int, **kw) -> DataLoader:
    return DataLoader(ds, batch_size=None, num_workers=workers, **kw)


def keys_of(batches) -> list[str]:
    return [s["__key__"] for b in batches for s in b]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_through_a_dataloader(dataset_daemon, data, workers):
    folder, want = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    batches = list(loader(ds, workers, pin_memory=True))
    assert all(isinstance(b, Batch) for b in batches)
    assert {b.worker for b in batches} == set(range(max(workers, 1)))
    got = keys_of(batches)
    assert len(got) == len(set(got)) == len(want)
    for b in batches:
        for s in b:
            assert s["txt"] == want[s["__key__"]]["txt"]


def test_ranks_times_workers_split_the_epoch_exactly_once(dataset_daemon, data):
    folder, want = data
    per_rank = []
    for rank in range(2):
        ds = CkptdIterableDataset(
            ckptd.DatasetSpec(
                folder, batch_size=BATCH, rank=rank, world_size=2, seed=4, even="off"
            ),
            socket=dataset_daemon.socket,
        )
        per_rank.append(keys_of(loader(ds, 2)))
    flat = per_rank[0] + per_rank[1]
    assert len(flat) == len(set(flat)) == len(want)


def test_a_worker_reads_as_a_finer_rank(dataset_daemon, data):
    """Worker w of W on rank r reads exactly what Client.dataset gives rank r*W+w of R*W."""
    folder, _ = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH, rank=1, world_size=2, seed=4, epoch=3),
        socket=dataset_daemon.socket,
    )
    by_worker: dict[int, list[str]] = {0: [], 1: []}
    for b in loader(ds, 2):
        by_worker[b.worker] += [s["__key__"] for s in b]
    with dataset_daemon.client() as c:
        for w in (0, 1):
            d = c.dataset(
                ckptd.DatasetSpec(
                    folder, batch_size=BATCH, rank=2 + w, world_size=4, seed=4, epoch=3
                )
            )
            assert by_worker[w] == [s["__key__"] for b in d for s in b]


def test_transform_collate_and_pin_memory(dataset_daemon, data):
    folder, want = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH),
        socket=dataset_daemon.socket,
        transform=to_tensors,
        collate_fn=default_collate,
    )
    n = 0
    for b in loader(ds, 2, pin_memory=True):
        assert isinstance(b, BatchDict)
        assert isinstance(b["label"], torch.Tensor) and b["label"].dtype == torch.int64
        for key, label, length in zip(b["key"], b["label"], b["length"], strict=True):
            assert int(label) == int(want[key]["cls"])
            assert int(length) == len(want[key]["txt"])
        n += len(b["key"])
    assert n == len(want)


def test_set_epoch_changes_the_order(dataset_daemon, data):
    folder, _ = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    first = keys_of(loader(ds, 0))
    assert keys_of(loader(ds, 0)) == first
    ds.set_epoch(1)
    second = keys_of(loader(ds, 0))
    assert second != first
    assert sorted(second) == sorted(first)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_after_the_observed_batches(dataset_daemon, data, workers):
    folder, want = data
    spec = ckptd.DatasetSpec(folder, batch_size=BATCH, seed=8, epoch=2)
    ds = CkptdIterableDataset(spec, socket=dataset_daemon.socket)
    seen: list[str] = []
    for i, b in enumerate(loader(ds, workers)):
        ds.observe(b)
        seen += [s["__key__"] for s in b]
        if i == 4:
            break
    state = ds.state_dict()
    assert state["num_workers"] == max(workers, 1)
    assert sum(state["positions"]) == len(seen)

    fresh = CkptdIterableDataset(replace(spec, epoch=0), socket=dataset_daemon.socket)
    fresh.load_state_dict(state)
    assert fresh.epoch == 2
    fresh.set_epoch(2)  # the loop's set_epoch for the resumed epoch keeps the positions
    rest = keys_of(loader(fresh, workers))
    assert len(seen) + len(rest) == len(want)
    assert set(seen) | set(rest) == set(want)

    fresh.set_epoch(3)  # a new epoch starts from the beginning
    assert len(keys_of(loader(fresh, workers))) == len(want)


def test_resuming_with_other_workers_is_refused(dataset_daemon, data):
    folder, _ = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    ds.load_state_dict(
        {"epoch": 0, "seed": 0, "rank": 0, "world_size": 1, "num_workers": 2, "positions": [8, 8]}
    )
    with pytest.raises(ValueError, match="2 DataLoader workers"):
        list(loader(ds, 0))
    with pytest.raises(ValueError, match="seed=5"):
        ds.load_state_dict(
            {"epoch": 0, "seed": 5, "rank": 0, "world_size": 1, "num_workers": 1, "positions": [0]}
        )


def test_observe_needs_a_tagged_batch(dataset_daemon, data):
    folder, _ = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    with pytest.raises(TypeError, match="observe"):
        ds.observe([{"__key__": "x"}])


def test_bad_arguments_surface_from_the_workers(dataset_daemon, data):
    folder, _ = data
    ds = CkptdIterableDataset(ckptd.DatasetSpec(folder, batch_size=0), socket=dataset_daemon.socket)
    with pytest.raises(ckptd.InvalidArgumentError, match="batch_size must be positive"):
        list(loader(ds, 0))
    with pytest.raises(ValueError, match="batch_size must be positive"):
        list(loader(ds, 2, timeout=scaled(60)))  # a hung worker fails, not the whole suite


def test_workers_forked_right_after_the_parent_read_start(dataset_daemon, data):
    """Workers forked while the parent's gRPC is busy read all the same.

    grpcio's core hung about one such worker in twenty under load (CI saw
    it); a forked worker's client now speaks HTTP/2 itself. timeout turns a
    hang into a failure.
    """
    folder, want = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    for _ in range(8):
        assert len(keys_of(loader(ds, 0))) == len(want)
        got = keys_of(loader(ds, 2, timeout=scaled(60)))
        assert sorted(got) == sorted(want)


def test_spawned_workers_with_a_client_open_in_the_parent(dataset_daemon, data):
    """Workers open their own clients; the parent's channel is never shared."""
    folder, want = data
    with dataset_daemon.client() as parent:
        parent.steps()  # gRPC is live in the parent when the workers start
        ds = CkptdIterableDataset(
            ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
        )
        for ctx in ("fork", "spawn"):
            got = keys_of(loader(ds, 2, multiprocessing_context=ctx))
            assert sorted(got) == sorted(want), ctx
        assert parent.steps() == []


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(dataset_daemon, data, ctx):
    """persistent_workers=True keeps the workers (and their copy of the dataset)
    from one epoch to the next: each epoch still reads its own order."""
    folder, want = data
    spec = ckptd.DatasetSpec(folder, batch_size=BATCH, seed=2)
    ds = CkptdIterableDataset(spec, socket=dataset_daemon.socket)
    kept = loader(ds, 2, persistent_workers=True, multiprocessing_context=ctx)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        batches = list(kept)
        assert {b.epoch for b in batches} == {epoch}
        orders.append(keys_of(batches))
    fresh = CkptdIterableDataset(spec, socket=dataset_daemon.socket)
    for epoch in range(2):
        fresh.set_epoch(epoch)
        assert orders[epoch] == keys_of(loader(fresh, 2, multiprocessing_context=ctx)), epoch
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(want)


def test_load_state_dict_after_persistent_workers_started_is_refused(dataset_daemon, data):
    folder, _ = data
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH), socket=dataset_daemon.socket
    )
    kept = loader(ds, 2, persistent_workers=True)
    first = list(kept)
    ds.observe(first[0])
    ds.load_state_dict(ds.state_dict())  # the workers hold the dataset of before
    with pytest.raises(ValueError, match="after this DataLoader's workers started"):
        list(kept)
    assert keys_of(loader(ds, 2))  # a new DataLoader resumes


def run_epoch_part(folder, rank: int, world: int, workers: int, batches: int, state=None):
    """One rank's DataLoader over epoch 1: keys of the first batches, and its state.

    The keys are in the order each worker read them, worker after worker.
    """
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(
            folder, batch_size=BATCH, rank=rank, world_size=world, seed=6, epoch=1, even="off"
        ),
        socket=SOCKET[0],
    )
    if state is not None:
        ds.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint holds it
    got: dict[int, list[str]] = {}
    for i, b in enumerate(loader(ds, workers)):
        if i == batches:
            break
        ds.observe(b)
        got.setdefault(b.worker, []).extend(s["__key__"] for s in b)
    return [k for _, ks in sorted(got.items()) for k in ks], ds.state_dict()


SOCKET: list[str] = [""]


def test_elastic_resume_through_the_dataloader(dataset_daemon, data):
    """4 ranks of 2 workers read part of an epoch; their gathered state resumes
    it at 3 ranks of 1 worker, and again at 2 ranks of 3: every sample once."""
    folder, want = data
    SOCKET[0] = dataset_daemon.socket
    seen: list[str] = []
    states = []
    for rank in range(4):
        got, state = run_epoch_part(folder, rank, 4, 2, batches=rank)
        seen += got
        states.append(json.loads(json.dumps(state)))
    state = CkptdIterableDataset.gathered(states)
    assert state["rank"] is None
    with pytest.raises(ValueError, match="gather_dataset_state"):
        run_epoch_part(folder, 0, 3, 1, batches=1, state=states[0])  # one rank's of 4
    middle = []
    for rank in range(3):
        got, s = run_epoch_part(folder, rank, 3, 1, batches=1, state=state)
        seen += got
        middle.append(s)
    state = CkptdIterableDataset.gathered(middle)
    for rank in range(2):
        got, _ = run_epoch_part(folder, rank, 2, 3, batches=-1, state=state)
        seen += got
    assert len(seen) == len(set(seen)) == len(want), len(seen)


def test_same_topology_replays_the_order(dataset_daemon, data):
    """At the same world size and num_workers a resume is the rest of the
    very order the saved run was reading, not a new deal."""
    folder, _ = data
    SOCKET[0] = dataset_daemon.socket
    whole, _ = run_epoch_part(folder, 1, 2, 1, batches=-1)
    first, state = run_epoch_part(folder, 1, 2, 1, batches=3)
    rest, _ = run_epoch_part(folder, 1, 2, 1, batches=-1, state=state)
    assert first + rest == whole


def test_gather_dataset_state_of_a_dataloader(dataset_daemon, data, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    folder, want = data
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ds = CkptdIterableDataset(
            ckptd.DatasetSpec(folder, batch_size=BATCH, seed=1), socket=dataset_daemon.socket
        )
        got = []
        for i, b in enumerate(loader(ds, 2)):
            if i == 3:
                break
            got += [s["__key__"] for s in ds.observe(b)]
        state = json.loads(json.dumps(ckptd.torch.gather_dataset_state(ds)))
    finally:
        dist.destroy_process_group()
    fresh = CkptdIterableDataset(
        ckptd.DatasetSpec(folder, batch_size=BATCH, seed=1), socket=dataset_daemon.socket
    )
    fresh.load_state_dict(state)
    rest = keys_of(loader(fresh, 3))  # another num_workers
    assert sorted(got + rest) == sorted(want)
