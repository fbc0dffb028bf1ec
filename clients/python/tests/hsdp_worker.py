"""One rank of an HSDP run saving or loading through ckptd.dcp (test_hsdp.py).

Usage: hsdp_worker.py MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR

A model of two nn.Linear layers (1.3 M parameters) with AdamW, sharded
with FSDP2 fully_shard on a CPU mesh (gloo). save (WORLD 4): hybrid
sharding, a 2 x 2 mesh (replicate, shard): each parameter's shard is held
by two ranks; two optimizer steps, then dcp.save through ckptd.dcp.Writer
(step 10); rank 0 writes the full (gathered) state to OUT_DIR/full.pt.
load (WORLD 4: the same hybrid mesh; 2: plain FSDP over 2 ranks): a
differently initialised model, trained a step, loaded from step 10 with
dcp.load through ckptd.dcp.Reader; rank 0 compares the gathered full state
with full.pt bit for bit and writes OUT_DIR/load_<WORLD>.json.
torch_save / torch_load: the same through ckptd.torch.save_state_dict and
load_state_dict (step 20; torch_full.pt, torch_load_<WORLD>.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from dcp_worker import diff, fsdp2, full, main, sharded, train
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import ckptd
import ckptd.dcp
import ckptd.torch

STEP = 10
TORCH_STEP = 20


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1280)
    )
    hybrid = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if world == 4
        else None
    )
    return fsdp2(model, world, hybrid), torch.optim.AdamW(model.parameters(), lr=1e-2)


def save(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=0)
    train(model, opt, 2, seed=1)
    dcp.save(sharded(model, opt), storage_writer=ckptd.dcp.Writer(client, STEP, job=job))
    f = full(model, opt)
    if rank == 0:
        torch.save(f, out / "full.pt")


def load(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=123)
    train(model, opt, 1, seed=7)  # optimizer state exists, and differs
    sd = sharded(model, opt)
    dcp.load(sd, storage_reader=ckptd.dcp.Reader(client, STEP, job=job))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = full(model, opt)
    if rank == 0:
        want = torch.load(out / "full.pt", weights_only=False)
        (out / f"load_{world}.json").write_text(json.dumps({"diff": diff(want, got)}))


def torch_save(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=0)
    train(model, opt, 2, seed=1)
    ckptd.torch.save_state_dict(client, TORCH_STEP, model, optimizer=opt, job=job).wait()
    f = full(model, opt)
    if rank == 0:
        torch.save(f, out / "torch_full.pt")


def torch_load(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=123)
    train(model, opt, 1, seed=7)
    ckptd.torch.load_state_dict(client, TORCH_STEP, model, optimizer=opt, job=job)
    got = full(model, opt)
    if rank == 0:
        want = torch.load(out / "torch_full.pt", weights_only=False)
        (out / f"torch_load_{world}.json").write_text(json.dumps({"diff": diff(want, got)}))


if __name__ == "__main__":
    main({"save": save, "load": load, "torch_save": torch_save, "torch_load": torch_load})
