"""ckptd.dcp: torch.distributed.checkpoint through a real daemon, real processes.

Four gloo processes on the CPU save an FSDP2-sharded model and its AdamW
state with dcp.save and dcp.async_save through ckptd.dcp.Writer; separate
runs of 4, 2 and 1 processes load both steps through ckptd.dcp.Reader
(resharding) and compare the gathered state bit for bit.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import launch as run_workers
from torch.distributed.checkpoint.api import CheckpointException

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


def test_each_rank_shard_describes_its_pieces(saved, daemon):
    """ckptd.sharding names every tensor piece, and the pieces tile each tensor once."""
    job, _ = saved
    covered: dict[tuple[str, str], np.ndarray] = {}
    with daemon.client() as c:
        for rank in range(SAVED_WORLD):
            shard = c.load(10, rank=rank, job=job, nested=False)
            described = _sharding.decode(shard[_sharding.TENSOR])
            names = set(shard) - {_sharding.TENSOR, ckptd.dcp.METADATA}
            tensors = {n for n in names if not n.startswith(f"{ckptd.dcp.BYTES}:")}
            assert set(described) == tensors, rank
            assert (ckptd.dcp.METADATA in shard) == (rank == 0)
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
    assert ("optimizer", "state.4.bias.step") in covered  # replicated: stored by one rank
    for key, cover in covered.items():
        assert (cover == 1).all(), key


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
