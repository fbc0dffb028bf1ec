"""One rank of a run saving or loading DTensors through ckptd.torch (test_torch_dtensor.py).

Usage: torch_dtensor_worker.py MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR

The model of dcp_worker.py (three nn.Linear layers whose sizes do not divide
by 4) with AdamW, sharded with FSDP2 fully_shard on a CPU mesh (gloo), not
through DCP: ckptd.torch.save_state_dict and load_state_dict.

save (WORLD 4): two optimizer steps, then save_state_dict (step 10) with an
  extra; rank 0 writes the full (gathered) state to OUT_DIR/full.pt and
  every full tensor by its export name (model fqn, optimizer.state.<id>.<k>)
  to OUT_DIR/export.pt.
load (any WORLD; 1: a plain, unsharded model): a differently initialised
  model on WORLD ranks, trained a step (so its optimizer state differs),
  loaded from step 10; rank 0 compares the gathered full state with
  full.pt bit for bit and writes OUT_DIR/load_<WORLD>.json. Then one more
  training step, which must run on the loaded state.
mesh2d (WORLD 4): two tensors distributed on a 2x2 mesh (Shard(0)/Shard(1),
  Replicate/Shard(0)) saved as step 20 (rank 0 writes them whole to
  OUT_DIR/mesh2d.pt), then loaded into a 1-D mesh's Shard(1) and Replicate
  placements and checked there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dcp_worker import diff, full, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptd
import ckptd.torch as ct

STEP = 10
MESH2D_STEP = 20


def build(world: int, seed: int, shard: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 13), torch.nn.ReLU(),
        torch.nn.Linear(13, 5),
    )  # fmt: skip
    if shard:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def export_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every full tensor, by the name `ckptd export --with-optimizer` gives it."""
    out = {k: whole(v) for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            out[f"optimizer.state.{i}.{k}"] = whole(v)
    return out


def save(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=0, shard=True)
    train(model, opt, 2, seed=1)
    handle = ct.save_state_dict(client, STEP, model, optimizer=opt, extra={"epoch": 3}, job=job)
    f = full(model, opt)
    names = export_names(model, opt)
    if rank == 0:
        torch.save(f, out / "full.pt")
        torch.save(names, out / "export.pt")
    handle.wait(120)


def load(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=123, shard=world > 1)
    train(model, opt, 1, seed=7)  # optimizer state exists, and differs
    shards: list[int] = []  # the ranks whose shards the load reads
    real = client.load

    def counted(*args: Any, **kw: Any) -> Any:
        shards.append(kw["rank"])
        return real(*args, **kw)

    client.load = counted  # type: ignore[method-assign]
    extra = ct.load_state_dict(client, STEP, model, optimizer=opt, job=job)
    client.load = real  # type: ignore[method-assign]
    got = full(model, opt)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, shards)
    report: dict[str, Any] = {"extra": extra, "shards": every}
    if rank == 0:
        want = torch.load(out / "full.pt", weights_only=False)
        report["diff"] = diff(want, got)
    train(model, opt, 1, seed=8)
    if rank == 0:
        (out / f"load_{world}.json").write_text(json.dumps(report))


def holder(**tensors: torch.Tensor) -> torch.nn.Module:
    """A module whose parameters are tensors."""
    m = torch.nn.Module()
    for name, t in tensors.items():
        m.register_parameter(name, torch.nn.Parameter(t))
    return m


def mesh2d(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    """Save from a 2x2 mesh (Shard/Shard, Replicate/Shard); load on a 1-D mesh of 4."""
    torch.manual_seed(0)
    w, r = torch.randn(7, 6), torch.randn(5, 3)  # the same on every rank
    mesh = init_device_mesh("cpu", (2, 2))
    src = holder(
        w=distribute_tensor(w, mesh, [Shard(0), Shard(1)]),
        r=distribute_tensor(r, mesh, [Replicate(), Shard(0)]),
    )
    ct.save_state_dict(client, MESH2D_STEP, src, job=job).wait(120)
    if rank == 0:
        torch.save({"w": w, "r": r}, out / "mesh2d.pt")
    line = init_device_mesh("cpu", (world,))
    dst = holder(
        w=distribute_tensor(torch.zeros(7, 6), line, [Shard(1)]),
        r=distribute_tensor(torch.zeros(5, 3), line, [Replicate()]),
    )
    ct.load_state_dict(client, MESH2D_STEP, dst, job=job)
    assert isinstance(dst.w, DTensor) and dst.w.placements == (Shard(1),)
    assert torch.equal(dst.w.full_tensor(), w) and torch.equal(dst.r.full_tensor(), r)


def main() -> None:
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with ckptd.Client(sock) as client:
        {"save": save, "load": load, "mesh2d": mesh2d}[mode](rank, world, client, job, Path(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
