"""One rank of a training loop that saves on preemption (test_preemption.py).

Usage: preempt_worker.py RANK WORLD INIT_FILE SOCKET JOB

Steps until ckptd.on_preemption() says to stop -- a collective, so every
rank stops at the same step whichever got the signal -- then saves that
step with ckptd.torch, waits for the commit, prints "saved N" and exits 0.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ckptd
import ckptd.torch as ct


def main() -> None:
    rank, world, init, sock, job = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    model = torch.nn.Linear(4, 2)
    with ckptd.Client(sock) as c, ct.on_preemption() as preempt:
        for step in range(1, 100_000):
            with torch.no_grad():
                model.weight.add_(1.0)  # a training step
            print(f"step {step}", flush=True)
            if preempt.requested():
                if preempt.signal is not None:
                    print(f"got {preempt.signal.name}", flush=True)
                ct.save_state_dict(c, step, model, job=job).wait(60)
                print(f"saved {step}", flush=True)
                break
            time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
