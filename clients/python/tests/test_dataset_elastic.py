"""An epoch read in part by 4 ranks resumes at 3 ranks from their elastic
states: every sample delivered exactly once, through the real daemon."""

from __future__ import annotations

import pytest
from wds import write_shards

import ckptd

SHARDS, PER, BATCH = 9, 10, 4


def test_elastic_resume_at_another_world_size(dataset_daemon, tmp_path):
    folder = tmp_path / "data"
    write_shards(folder, SHARDS, PER)
    seen: dict[str, int] = {}
    blobs: list[bytes] = []
    spec = dict(batch_size=BATCH, seed=3, epoch=1, shuffle_window=8)
    with dataset_daemon.client() as c:
        for rank in range(4):
            with c.dataset(ckptd.DatasetSpec(folder, rank=rank, world_size=4, **spec)) as ds:
                for _, batch in zip(range(rank + 1), ds, strict=False):
                    for s in batch:
                        seen[s["__key__"]] = seen.get(s["__key__"], 0) + 1
                state = ds.state(elastic=True)
                assert state["start"] == 0 and len(state["delivered"]) == 1
                blobs += state["delivered"]
        for rank in range(3):
            resumed = ckptd.DatasetSpec(folder, rank=rank, world_size=3, delivered=blobs, **spec)
            with c.dataset(resumed) as ds:
                for batch in ds:
                    for s in batch:
                        seen[s["__key__"]] = seen.get(s["__key__"], 0) + 1
    assert len(seen) == SHARDS * PER
    assert all(n == 1 for n in seen.values()), {k: n for k, n in seen.items() if n != 1}


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
                state = ckptd.gather_dataset_state(ds)
            assert state["rank"] is None and state["world_size"] is None
            assert state["start"] == 0 and len(state["delivered"]) == 1
            with c.dataset(ckptd.DatasetSpec(**{**state, "rank": 0, "world_size": 1})) as rest:
                keys = [s["__key__"] for b in rest for s in b]
        assert len(keys) == 12 - len(first)
        assert not {s["__key__"] for s in first} & set(keys)
    finally:
        dist.destroy_process_group()
