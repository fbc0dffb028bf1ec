"""ckptd.torch with DTensors, without DCP: real processes, a real daemon.

Four gloo processes on the CPU save an FSDP2-sharded model and its AdamW
state with save_state_dict; separate runs of 4, 2 and 1 (unsharded)
processes load it with load_state_dict and compare the gathered state bit
for bit; `ckptd export` puts the pieces back together from the
ckptd.sharding description the ranks wrote.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from launch import launch as run_workers
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd
import ckptd.torch as ct
from ckptd import _sharding

WORKER = Path(__file__).with_name("torch_dtensor_worker.py")
SAVED_WORLD = 4
STEP = 10


def launch(mode: str, world: int, socket: str, job: str, out: Path) -> None:
    """Run world workers of this test, as torchrun would, and wait for them."""
    run_workers(WORKER, mode, world, socket, job, out)


@pytest.fixture(scope="module")
def saved(daemon, tmp_path_factory):
    """A job whose step 10 four FSDP2 ranks saved with save_state_dict."""
    out = tmp_path_factory.mktemp("dtensor")
    job = "torch-dtensor-fsdp2"
    launch("save", SAVED_WORLD, daemon.socket, job, out)
    return job, out


def test_each_rank_stores_its_pieces_and_describes_them(saved, daemon):
    job, _ = saved
    covered: dict[tuple[str, str], np.ndarray] = {}
    with daemon.client() as c:
        for rank in range(SAVED_WORLD):
            shard = c.load(STEP, rank=rank, job=job, nested=False)
            assert shard.world_size == SAVED_WORLD
            skeleton = json.loads(shard[ct.SKELETON].tobytes())
            assert skeleton["format"] == 2
            described = _sharding.decode(shard[_sharding.TENSOR])
            for name, p in described.items():
                if p.fqn.endswith(".step"):  # plain (replicated): described by rank 0 only
                    assert rank == 0 and name == f"optimizer:{p.fqn.replace('.', ':')}"
                else:
                    assert name == f"{p.group}:{p.fqn}", name  # one piece per rank
                shape = shard[name].shape
                cover = covered.setdefault((p.group, p.fqn), np.zeros(p.global_shape, np.int64))
                cover[tuple(slice(o, o + n) for o, n in zip(p.offsets, shape, strict=True))] += 1
            assert "model:4.weight" in described and "optimizer:state.5.exp_avg_sq" in described
    assert covered[("model", "2.weight")].shape == (13, 16)
    assert ("optimizer", "state.0.step") in covered
    for key, cover in covered.items():
        assert (cover == 1).all(), key


@pytest.mark.parametrize("world", [4, 2, 1])
def test_load_reshards_bit_for_bit(saved, daemon, world):
    job, out = saved
    launch("load", world, daemon.socket, job, out)
    report = json.loads((out / f"load_{world}.json").read_text())
    assert report["extra"] == {"epoch": 3}
    assert report["diff"] == []
    if world == SAVED_WORLD:  # the same layout: each rank reads its own shard only
        assert report["shards"] == [[r] for r in range(world)]
    else:  # its own, then every other saved rank's, once
        want = [[r, *(o for o in range(SAVED_WORLD) if o != r)] for r in range(world)]
        assert report["shards"] == want


def test_export_assembles_the_full_tensors(saved, daemon, ckptd_bin, tmp_path):
    job, out = saved
    subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job,
         "--step", str(STEP), "--out", str(tmp_path / "export"), "--with-optimizer"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    got = load_file(tmp_path / "export" / "model.safetensors")
    want = torch.load(out / "export.pt", weights_only=False)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), name


def test_a_2d_mesh_with_replicas_saves_loads_and_exports(daemon, ckptd_bin, job, tmp_path):
    launch("mesh2d", SAVED_WORLD, daemon.socket, job, tmp_path)  # it checks its load itself
    with daemon.client() as c:
        described = [
            _sharding.decode(c.load(20, rank=r, job=job)[_sharding.TENSOR])
            for r in range(SAVED_WORLD)
        ]
    pieces = [d["model:r"] for d in described if "model:r" in d]
    assert sorted(p.offsets for p in pieces) == [(0, 0), (3, 0)]  # each replica's piece once
    subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job,
         "--step", "20", "--out", str(tmp_path / "export")],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    got = load_file(tmp_path / "export" / "model.safetensors")
    want = torch.load(tmp_path / "mesh2d.pt")
    assert set(got) == {"w", "r"}
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["r"], want["r"])


@pytest.fixture
def mesh_of_one(tmp_path):
    """A 1-D device mesh over an in-process gloo group of one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_plain_tensors_load_into_dtensors_and_a_missing_rank_reads_rank_0(client, job, mesh_of_one):
    plain = torch.nn.Linear(3, 2)
    ct.save_state_dict(client, 1, plain, rank=0, world_size=1, job=job).wait(30)
    sharded = torch.nn.Linear(3, 2)
    fully_shard(sharded, mesh=mesh_of_one)
    ct.load_state_dict(client, 1, sharded, job=job)  # plain saved, DTensors loaded
    assert isinstance(sharded.weight, DTensor)
    assert torch.equal(sharded.weight.full_tensor(), plain.weight.detach())

    ct.save_state_dict(client, 2, sharded, rank=0, world_size=1, job=job).wait(30)
    again = torch.nn.Linear(3, 2)
    fully_shard(again, mesh=mesh_of_one)
    ct.load_state_dict(client, 2, again, rank=3, job=job)  # rank 3 of 1: rank 0's pieces
    assert torch.equal(again.bias.full_tensor(), plain.bias.detach())
    with pytest.raises(ckptd.InvalidArgumentError, match="rank 3 out of range"):
        ct.load_state_dict(client, 1, plain, rank=3, job=job)  # not sharded: no fallback


def test_a_save_without_dtensors_is_still_format_1(client, job):
    model = torch.nn.Linear(3, 2)
    ct.save_state_dict(client, 1, model, rank=0, world_size=1, job=job).wait(30)
    shard = client.load(1, rank=0, job=job, nested=False)
    assert json.loads(shard[ct.SKELETON].tobytes())["format"] == 1
    assert _sharding.TENSOR not in shard
