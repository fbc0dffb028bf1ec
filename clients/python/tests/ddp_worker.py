"""One rank of a DDP run saving or loading through ckptd.torch (test_torch_replicated.py).

Usage: ddp_worker.py MODE RANK WORLD INIT SOCKET JOB OUT

save: trains a DDP model (gloo, CPU) for 3 steps, saves step 3 with
save_state_dict (replicated, as a DDP module is by default) and writes
its weights, optimizer state and extra to OUT/saved-RANK.pt; then loads,
as load does.
load: loads the newest step into a fresh DDP model and optimizer and
writes the same to OUT/loaded-WORLD-RANK.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ckptd
import ckptd.torch as ct


def build() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same start on every rank, as DDP requires
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: object) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": extra}


def main() -> None:
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model, opt = build()
    with ckptd.Client(sock) as c:
        if mode == "save":
            torch.manual_seed(100 + rank)  # each rank its own batches
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(32, 256)).pow(2).mean().backward()
                opt.step()
            extra = {"rank": rank, "rng": torch.get_rng_state()}
            ct.save_state_dict(c, 3, model, optimizer=opt, extra=extra, job=job).wait(120)
            torch.save(snapshot(model, opt, extra), Path(out) / f"saved-{rank}.pt")
            dist.barrier()  # every rank's save committed: load it back at this world size
            model, opt = build()
        extra = ct.load_state_dict(c, "latest", model, optimizer=opt, job=job)
        torch.save(snapshot(model, opt, extra), Path(out) / f"loaded-{world}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
