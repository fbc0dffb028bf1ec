"""ckptd.dcp: torch.distributed.checkpoint through a real daemon, real processes.

Four gloo processes on the CPU save an FSDP2-sharded model and its AdamW
state with dcp.save and dcp.async_save through ckptd.dcp.Writer; separate
runs of 4, 2 and 1 processes load both steps through ckptd.dcp.Reader
(resharding) and compare the gathered state bit for bit.
"""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import launch as run_workers
from slow import scaled
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import ckptd
import ckptd.dcp
from ckptd import _sharding

WORKER = Path(__file__).with_name("dcp_worker.py")
SAVED_WORLD = 4


def launch(mode: str, world: int, socket: str, job: str, out: Path) -> None:
    """Run world workers of this test, as torchrun would, and wait for them."""
    run_workers(WORKER, mode, world, socket, job, out)


@pytest.fixture(scope="module")
def saved(daemon, tmp_path_factory):
    """A job whose steps 10 (dcp.save) and 11 (dcp.async_save) four ranks saved."""
    out = tmp_path_factory.mktemp("dcp")
    job = "dcp-fsdp2"
    launch("save", SAVED_WORLD, daemon.socket, job, out)
    return job, out


def test_the_saved_steps_are_committed_with_world_size_4(saved, daemon, ckptd_bin):
    job, _ = saved
    listed = subprocess.run(
        [str(ckptd_bin), "list", "--storage", str(daemon.storage), "--job", job, "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    steps = {s["step"]: s for s in json.loads(listed.stdout)}
    assert set(steps) == {10, 11}, listed.stdout
    assert all(s["world_size"] == SAVED_WORLD for s in steps.values()), listed.stdout


@pytest.mark.parametrize("world", [4, 2, 1])
def test_load_reshards_bit_for_bit(saved, daemon, world):
    job, out = saved
    launch("load", world, daemon.socket, job, out)
    report = json.loads((out / f"load_{world}.json").read_text())
    assert report["10"] == {"step": 10, "diff": []}
    assert report["latest"] == {"step": 11, "diff": []}


@pytest.mark.parametrize("step", [10, 11])
def test_each_rank_shard_describes_its_pieces(saved, daemon, step):
    """ckptd.sharding names every tensor piece, and the pieces tile each tensor once.

    Step 11 (async_save) stages without collectives: each rank stores its
    own copy of the plain (replicated) tensors, which only rank 0 describes.
    """
    job, _ = saved
    covered: dict[tuple[str, str], np.ndarray] = {}
    with daemon.client() as c:
        for rank in range(SAVED_WORLD):
            shard = c.load(step, rank=rank, job=job, nested=False)
            described = _sharding.decode(shard[_sharding.TENSOR])
            names = set(shard) - {_sharding.TENSOR}
            tensors = {n for n in names if not n.startswith(f"{ckptd.dcp.BYTES}:")}
            if step == 10 or rank == 0:
                assert set(described) == tensors, rank
            else:
                assert set(described) <= tensors, rank
            assert ckptd.dcp.METADATA not in shard  # small: the save's metadata
            md = pickle.loads(shard.metadata) if rank == 0 else None
            assert isinstance(md, Metadata) if rank == 0 else shard.metadata == b""
            for name, p in described.items():
                assert name == f"{p.group}:{p.fqn}"  # one piece of each per rank here
                shape = shard[name].shape
                cover = covered.setdefault((p.group, p.fqn), np.zeros(p.global_shape, np.int64))
                box = tuple(slice(o, o + n) for o, n in zip(p.offsets, shape, strict=True))
                assert all(
                    o + n <= g for o, n, g in zip(p.offsets, shape, p.global_shape, strict=True)
                ), name
                cover[box] += 1
    assert covered[("model", "0.weight")].shape == (16, 8)
    assert ("optimizer", "state.4.bias.exp_avg_sq") in covered
    assert ("optimizer", "state.4.bias.step") in covered  # replicated: described by one rank
    for key, cover in covered.items():
        assert (cover == 1).all(), key


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_metadata_too_large_for_a_request_is_a_tensor(client, job, monkeypatch, how):
    """Metadata over MAX_METADATA goes in rank 0's dcp.metadata tensor, and loads the same."""
    monkeypatch.setattr(ckptd.dcp._limits, "MAX_METADATA", 16)
    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": {"n": 7}}
    writer = ckptd.dcp.Writer(client, 3, job=job)
    if how == "save":
        dcp.save(sd, storage_writer=writer)
    else:
        fut = dcp.async_save(sd, storage_writer=writer)
        sd["model"]["w"].add_(100)  # the staged copy is in the daemon
        fut.result(timeout=scaled(120))
        sd["model"]["w"].sub_(100)
    shard = client.load(3, rank=0, job=job, nested=False)
    assert ckptd.dcp.METADATA in shard and shard.metadata == b""
    got = {"model": {"w": torch.zeros(2, 3)}, "extra": {"n": 0}}
    dcp.load(got, storage_reader=ckptd.dcp.Reader(client, 3, job=job))
    assert torch.equal(got["model"]["w"], sd["model"]["w"]) and got["extra"]["n"] == 7


def test_reader_for_an_unknown_step_says_so(saved, daemon):
    job, _ = saved
    with daemon.client() as c:
        reader = ckptd.dcp.Reader(c, 99, job=job)
        with pytest.raises(ckptd.NotFoundError, match="99"):
            reader.read_metadata()
        # dcp.load reports every rank's failure (one here) in a CheckpointException.
        with pytest.raises(CheckpointException, match=r"step 99 .* is not committed"):
            dcp.load({"x": torch.zeros(1)}, storage_reader=ckptd.dcp.Reader(c, 99, job=job))
        assert ckptd.dcp.Reader(c, "latest", job=job).read_metadata().state_dict_metadata
        with pytest.raises(TypeError):
            ckptd.dcp.Reader(c, "newest", job=job)  # type: ignore[arg-type]


def test_reader_refuses_a_step_not_saved_by_the_writer(client, job):
    client.save(1, {"w": torch.ones(2)}, rank=0, world_size=1, job=job).wait(30)
    with pytest.raises(ckptd.CkptdError, match=r"not saved by ckptd\.dcp\.Writer"):
        ckptd.dcp.Reader(client, 1, job=job).read_metadata()
