"""One rank of a DDP-style loop over an uneven dataset (test_dataset_even.py).

Usage: even_worker.py RANK WORLD INIT_FILE SOCKET DATA EVEN OUT_JSON

Reads one epoch through a DataLoader of 2 workers over CkptdIterableDataset
and, like DDP's backward, all_reduces every step: a rank with fewer batches
would leave the others waiting in that collective. Each rank then sends
its step count and keys to rank 0, which writes them to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ckptd
from ckptd.torch import CkptdIterableDataset


def main() -> None:
    rank, world, init, sock, data, even, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),  # a hung collective fails the test instead of stalling it
    )  # fmt: skip
    ds = CkptdIterableDataset(
        ckptd.DatasetSpec(data, batch_size=4, seed=5, epoch=1, even=even),
        socket=sock,
        timeout=120,
    )
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    steps, keys = 0, []
    grad = torch.zeros(1)
    for batch in loader:
        keys += [s["__key__"] for s in batch]
        grad.fill_(len(batch))
        dist.all_reduce(grad)  # the gradients' all-reduce of DDP's backward
        steps += 1
    dist.barrier()  # the epoch's end, reached by every rank
    every = [None] * world
    dist.all_gather_object(every, {"steps": steps, "keys": keys})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
