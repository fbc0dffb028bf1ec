"""Client.dataset over a mixture of sources, against a real daemon."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from wds import write_shards

import ckptd

MDS = Path(__file__).resolve().parents[3] / "prefetch" / "testdata" / "mds"


@pytest.fixture
def dc(dataset_daemon):
    with dataset_daemon.client() as c:
        yield c


@pytest.fixture
def sources(tmp_path):
    """Tar shards "a" (4 of 10 samples), "b" (2 of 10) and an MDS dataset (4 shards, 30 samples)."""
    write_shards(tmp_path / "a", 4, 10)
    write_shards(tmp_path / "b", 2, 10)
    shutil.copytree(MDS / "zstd", tmp_path / "m")
    return tmp_path


def keys(c: ckptd.Client, spec: ckptd.DatasetSpec) -> list[str]:
    with c.dataset(spec) as ds:
        return [s["__key__"] for batch in ds for s in batch]


def test_weights_share_each_epoch(dc, sources):
    # 10 shards in all: a gets 2 of each epoch's reads, b 4, the MDS source 4.
    mix = [
        (sources / "a", 1),
        (sources / "b", 2, "webdataset"),
        {"source": sources / "m", "weight": 2},
    ]
    per_epoch = []
    for epoch in range(2):
        got = keys(dc, ckptd.DatasetSpec(mix, epoch=epoch, seed=3, batch_size=6))
        per_epoch.append(Counter(k.split("/", 1)[0] for k in got))
    assert per_epoch[0] == per_epoch[1] == Counter({"0": 20, "1": 40, "2": 30})


def test_source_epochs_are_exactly_once(dc, sources):
    mix = [(sources / "a", 1), (sources / "b", 2)]
    a, b = Counter(), Counter()
    for epoch in range(2):  # a's first epoch spans mixture epochs 0 and 1
        for rank in range(2):
            spec = ckptd.DatasetSpec(mix, epoch=epoch, rank=rank, world_size=2, even="off")
            for k in keys(dc, spec):
                src, key = k.split("/", 1)
                (a if src == "0" else b)[key] += 1
    assert len(a) == 40 and set(a.values()) == {1}
    assert len(b) == 20 and set(b.values()) == {4}  # two epochs of b in each mixture epoch


def test_state_resumes_a_mixture(dc, sources):
    mix = [(str(sources / "a"), 1.0), (str(sources / "m"), 0.5, "mds")]
    spec = ckptd.DatasetSpec(mix, seed=7, batch_size=4)
    whole = keys(dc, spec)
    with dc.dataset(spec) as ds:
        it = iter(ds)
        head = [s["__key__"] for _ in range(3) for s in next(it)]
        state = ds.state()
    state = json.loads(json.dumps(state))  # what a checkpoint keeps
    assert ckptd.DatasetSpec(**state).mixture == spec.mixture
    assert head + keys(dc, ckptd.DatasetSpec(**state)) == whole


def test_bad_mixtures_are_refused(dc, sources):
    with pytest.raises(ckptd.InvalidArgumentError, match="weight"):
        keys(dc, ckptd.DatasetSpec([(sources / "a", 0)]))
    with pytest.raises(ckptd.InvalidArgumentError, match="at least one"):
        ckptd.DatasetSpec([])
    with pytest.raises(TypeError, match="weight"):
        ckptd.DatasetSpec([(sources / "a", "1")])
    with pytest.raises(TypeError, match="mixture"):
        ckptd.DatasetSpec([sources / "a"])


def test_mixture_through_a_dataloader(dataset_daemon, sources):
    from torch.utils.data import DataLoader

    from ckptd.torch import CkptdIterableDataset

    mix = [(sources / "a", 1), (sources / "m", 1, "mds")]  # 4 + 4 shards: each its own count
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(mix, batch_size=5, seed=2), socket=dataset_daemon.socket
    )
    got = [s["__key__"] for b in DataLoader(ds, batch_size=None, num_workers=2) for s in b]
    assert len(got) == len(set(got)) == 40 + 30
    assert Counter(k.split("/", 1)[0] for k in got) == Counter({"0": 40, "1": 30})
