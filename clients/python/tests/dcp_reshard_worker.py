"""One rank of test_dcp_reshard.py: save through ckptd.dcp, or load at another world size.

Usage: dcp_reshard_worker.py MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR

The state: LAYERS weights and their AdamW moments, each a Shard(0) DTensor
of a ROWS x COLS float32 tensor whose every element is a function of its
place (so any world size knows what it must load), plus the plain values
DCP takes to be replicated (the optimizer's step, its param_groups).

save (WORLD 4): dcp.save through ckptd.dcp.Writer, step 1.
load (any WORLD): dcp.load of step 1 into zeroed tensors through
  ckptd.dcp.Reader; each rank checks its pieces bit for bit and writes the
  tensor bytes it loaded to OUT_DIR/loaded_<WORLD>_<RANK>.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptd
import ckptd.dcp

LAYERS = 4
ROWS, COLS = 96, 1024  # 384 KiB a tensor; 96 rows split 4, 2 and 3 ways
MOMENTS = ("exp_avg", "exp_avg_sq")


def full(name: str, i: int) -> torch.Tensor:
    """The saved value of tensor name of layer i, all of it."""
    seed = sum(map(ord, name)) * 31 + i  # not hash(): str hashes differ by process
    x = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return torch.sin(x * 0.001 + seed)


def state(world: int, zero: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))

    def piece(name: str, i: int) -> DTensor:
        t = full(name, i)
        return distribute_tensor(torch.zeros_like(t) if zero else t, mesh, [Shard(0)])

    model = {f"layers.{i}.weight": piece("w", i) for i in range(LAYERS)}
    optim = {
        f"layers.{i}.weight": {
            MOMENTS[0]: piece("m", i),
            MOMENTS[1]: piece("v", i),
            "step": torch.tensor(0.0 if zero else 7.0),
        }
        for i in range(LAYERS)
    }
    lr = 0.0 if zero else 1e-3
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": lr}]}}


def check(sd: dict[str, Any], world: int) -> int:
    """Compare the loaded state with the saved one; the tensor bytes this rank holds."""
    want = state(world, zero=False)
    n = 0
    for i in range(LAYERS):
        k = f"layers.{i}.weight"
        got = [sd["model"][k], *(sd["optim"]["state"][k][s] for s in MOMENTS)]
        exp = [want["model"][k], *(want["optim"]["state"][k][s] for s in MOMENTS)]
        for g, e in zip(got, exp, strict=True):
            local = g.to_local()
            assert torch.equal(local.view(torch.int32), e.to_local().view(torch.int32)), k
            n += local.nbytes
        assert sd["optim"]["state"][k]["step"].item() == 7.0
    assert sd["optim"]["param_groups"][0]["lr"] == 1e-3
    return n


def main() -> None:
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with ckptd.Client(sock) as client:
        if mode == "save":
            dcp.save(state(world, zero=False), storage_writer=ckptd.dcp.Writer(client, 1, job=job))
        else:
            sd = state(world, zero=True)
            dcp.load(sd, storage_reader=ckptd.dcp.Reader(client, 1, job=job))
            Path(out, f"loaded_{world}_{rank}").write_text(str(check(sd, world)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
