"""One rank of a torch.distributed run saving through ckptd.torch (test_torch_dist.py).

Usage: dist_worker.py RANK WORLD INIT_FILE SOCKET JOB STEP OUT_JSON

Saves STEP (rank and world size given) and STEP+1 (left to their default,
torch.distributed's) with save_state_dict, gathers every rank's attempts
and ckptd warnings on rank 0, which writes them to OUT_JSON, then waits
for both steps to commit.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist

import ckptd
import ckptd.torch as ct


def main() -> None:
    rank, world, init, sock, job, step, out = sys.argv[1:8]
    rank, world, step = int(rank), int(world), int(step)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    with ckptd.Client(sock) as c, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = ct.save_state_dict(c, step, model, rank=rank, world_size=world, job=job)
        second = ct.save_state_dict(c, step + 1, model, job=job)  # ranks: torch.distributed's
        mine = {
            "client": c.attempt,
            "first": first.attempt,
            "second": second.attempt,
            "warnings": [str(w.message) for w in rec if "ckptd" in str(w.message)],
        }
        every = [None] * world
        dist.all_gather_object(every, mine)
        first.wait(60)
        second.wait(60)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
