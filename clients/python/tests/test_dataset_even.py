"""Every rank of an epoch gets the same number of samples (DatasetSpec.even),
through a real daemon: shards of uneven sizes dealt whole to 3 ranks, and a
gloo DDP-style loop over a DataLoader that reaches the epoch's end on every
rank."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from launch import run_ranks
from wds import make_samples, shard_bytes

import ckptd

COUNTS = [30, 7, 19, 25, 3, 41, 12, 16, 9, 22]  # samples per shard
WORLD, BATCH = 3, 4
WORKER = Path(__file__).with_name("even_worker.py")


def uneven(folder: Path) -> set[str]:
    """Shards of COUNTS samples each in folder; every sample's key."""
    folder.mkdir(parents=True, exist_ok=True)
    keys: set[str] = set()
    for i, n in enumerate(COUNTS):
        samples = make_samples(i, n)
        (folder / f"train-{i:03d}.tar").write_bytes(shard_bytes(samples))
        keys |= set(samples)
    return keys


def epoch_of(c: ckptd.Client, folder: Path, even: str) -> tuple[list[list[str]], int]:
    """Each rank's keys of epoch 1, and the samples padded in all."""
    per_rank, padded = [], 0
    for rank in range(WORLD):
        spec = ckptd.DatasetSpec(
            folder, batch_size=BATCH, rank=rank, world_size=WORLD, seed=5, epoch=1, even=even
        )
        with c.dataset(spec) as ds:
            per_rank.append([s["__key__"] for b in ds for s in b])
            padded += ds.stats().padded
    return per_rank, padded


def test_uneven_shards_reach_the_same_count_on_every_rank(dataset_daemon, tmp_path):
    want = uneven(tmp_path / "data")
    with dataset_daemon.client() as c:
        off, none = epoch_of(c, tmp_path / "data", "off")
        pad, padded = epoch_of(c, tmp_path / "data", "pad")
        default, _ = epoch_of(c, tmp_path / "data", "pad")
        drop, dropped_pad = epoch_of(c, tmp_path / "data", "drop")
        with pytest.raises(ckptd.InvalidArgumentError, match="unknown even"):
            epoch_of(c, tmp_path / "data", "sometimes")
    counts = [len(ks) for ks in off]
    assert len(set(counts)) > 1 and none == 0  # dealt whole: uneven (what hangs a DDP job)
    assert sorted(k for ks in off for k in ks) == sorted(want)

    assert [len(ks) for ks in pad] == [max(counts)] * WORLD
    flat = [k for ks in pad for k in ks]
    assert set(flat) == want and len(flat) - len(want) == padded > 0
    for own, ks in zip(off, pad, strict=True):
        assert ks[: len(own)] == own  # the rank's own order, then the repeats
    assert default == pad

    assert [len(ks) for ks in drop] == [min(counts)] * WORLD and dropped_pad == 0
    flat = [k for ks in drop for k in ks]
    assert len(flat) == len(set(flat))
    for own, ks in zip(off, drop, strict=True):
        assert ks == own[: len(ks)]  # the first samples of the rank's order


def test_a_ddp_loop_reaches_the_epochs_end_on_every_rank(dataset_daemon, tmp_path):
    """3 gloo ranks, each a DataLoader of 2 workers over CkptdIterableDataset
    (the default even, pad), all_reduce every step as DDP's backward does:
    all of them end the epoch, every sample delivered."""
    want, even = uneven(tmp_path / "data"), "pad"
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-even-"))
    try:
        args = [
            str(WORLD), str(tmp / "store"), dataset_daemon.socket, str(tmp_path / "data"),
            even, str(tmp / "out.json"),
        ]  # fmt: skip
        run_ranks(lambda r: [str(WORKER), str(r), *args], WORLD, f"even={even}", timeout=240)
        result = json.loads((tmp / "out.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    steps = {r["steps"] for r in result}
    assert len(steps) == 1, result  # every rank took the same number of steps
    keys = [k for r in result for k in r["keys"]]
    assert len({len(r["keys"]) for r in result}) == 1
    assert set(keys) == want
