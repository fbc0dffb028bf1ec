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
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_worker import diff, full, sharded, train
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd
import ckptd.dcp

STEP = 10


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1280)
    )
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


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


def main() -> None:
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with ckptd.Client(sock) as client:
        (save if mode == "save" else load)(rank, world, client, job, Path(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
