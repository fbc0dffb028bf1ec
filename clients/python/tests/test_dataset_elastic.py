"""An epoch read in part by 4 ranks resumes at 3 ranks from their elastic
states: every sample delivered exactly once, through the real daemon, the
states going through JSON as a trainer's checkpoint would hold them."""

from __future__ import annotations

import json

import pytest
from wds import write_shards

import ckptd

SHARDS, PER, BATCH = 9, 10, 4


def resume_4_to_3(c: ckptd.Client, folder, even: str) -> tuple[dict[str, int], int, list[int]]:
    """Read part of an epoch at 4 ranks, resume it at 3 from the JSON'd states.

    Returns how often each key came, the samples padded, and each resumed
    rank's count.
    """
    seen: dict[str, int] = {}
    states: list[str] = []
    spec = dict(batch_size=BATCH, seed=3, epoch=1, shuffle_window=8, even=even)
    for rank in range(4):
        with c.dataset(ckptd.DatasetSpec(folder, rank=rank, world_size=4, **spec)) as ds:
            for _, batch in zip(range(rank + 1), ds, strict=False):
                for s in batch:
                    seen[s["__key__"]] = seen.get(s["__key__"], 0) + 1
            state = ds.state(elastic=True)
            assert state["start"] == 0 and len(state["delivered"]) == 1
            states.append(json.dumps(state))  # as a checkpoint holds it
    blobs = [b for text in states for b in json.loads(text)["delivered"]]
    padded, counts = 0, []
    for rank in range(3):
        resumed = ckptd.DatasetSpec(folder, rank=rank, world_size=3, delivered=blobs, **spec)
        with c.dataset(resumed) as ds:
            n = 0
            for batch in ds:
                for s in batch:
                    seen[s["__key__"]] = seen.get(s["__key__"], 0) + 1
                n += len(batch)
            padded += ds.stats().padded
            counts.append(n)
    return seen, padded, counts


def test_elastic_resume_at_another_world_size(dataset_daemon, tmp_path):
    folder = tmp_path / "data"
    write_shards(folder, SHARDS, PER)
    with dataset_daemon.client() as c:
        seen, padded, _ = resume_4_to_3(c, folder, "off")
    assert len(seen) == SHARDS * PER
    assert all(n == 1 for n in seen.values()), {k: n for k, n in seen.items() if n != 1}
    assert padded == 0


def test_elastic_resume_of_an_even_epoch(dataset_daemon, tmp_path):
    """With pad (the default) the resumed ranks deliver the same count, and
    every sample comes once apart from the padding, which no position holds."""
    folder = tmp_path / "data"
    write_shards(folder, SHARDS, PER)
    with dataset_daemon.client() as c:
        seen, padded, counts = resume_4_to_3(c, folder, "pad")
    assert len(seen) == SHARDS * PER
    assert sum(seen.values()) - len(seen) == padded > 0
    assert len(set(counts)) == 1, counts


def test_state_goes_through_json(dataset_daemon, tmp_path):
    """The README's json.dumps(ds.state()): both kinds of state, as they are."""
    folder = tmp_path / "data"
    write_shards(folder, 3, 8)
    with dataset_daemon.client() as c:
        spec = ckptd.DatasetSpec(folder, batch_size=4, rank=0, world_size=1, seed=2)
        whole = [s["__key__"] for b in c.dataset(spec) for s in b]
        with c.dataset(spec) as ds:
            first = [s["__key__"] for s in next(iter(ds))]
            meta = json.dumps(ds.state())
            elastic = json.dumps(ds.state(elastic=True))
        rest = [s["__key__"] for b in c.dataset(ckptd.DatasetSpec(**json.loads(meta))) for s in b]
        assert first + rest == whole
        again = [
            s["__key__"] for b in c.dataset(ckptd.DatasetSpec(**json.loads(elastic))) for s in b
        ]
        assert sorted(first + again) == sorted(whole)
        with pytest.raises(ckptd.InvalidArgumentError, match="not base64"):
            ckptd.DatasetSpec(folder, rank=0, world_size=1, delivered=["not base64!"])


def test_elastic_state_needs_an_open_epoch(dataset_daemon, tmp_path):
    folder = tmp_path / "data"
    write_shards(folder, 1, 4)
    with dataset_daemon.client() as c:
        ds = c.dataset(ckptd.DatasetSpec(folder, batch_size=4, rank=0, world_size=1))
        list(ds)
        with pytest.raises(ckptd.CkptdError, match="closed"):
            ds.state(elastic=True)
        with pytest.raises(TypeError):
            ckptd.DatasetSpec(folder, rank=0, world_size=1, delivered=b"x")  # type: ignore[arg-type]


def test_gather_dataset_state(dataset_daemon, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    folder = tmp_path / "data"
    write_shards(folder, 3, 4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with dataset_daemon.client() as c:
            with c.dataset(ckptd.DatasetSpec(folder, batch_size=2, rank=0, world_size=1)) as ds:
                first = next(iter(ds))
                state = json.loads(json.dumps(ckptd.gather_dataset_state(ds)))
            assert state["rank"] is None and state["world_size"] is None
            assert state["start"] == 0 and len(state["delivered"]) == 1
            with c.dataset(ckptd.DatasetSpec(**{**state, "rank": 0, "world_size": 1})) as rest:
                keys = [s["__key__"] for b in rest for s in b]
        assert len(keys) == 12 - len(first)
        assert not {s["__key__"] for s in first} & set(keys)
    finally:
        dist.destroy_process_group()
