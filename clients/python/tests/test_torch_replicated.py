"""A DDP job's checkpoint takes the room of one rank's state, not of every rank's.

Four real processes train a DDP model (gloo, CPU) and save through
ckptd.torch: rank 0 stores the model and optimizer, the others only their
own extra. Loading at 4 and at 2 ranks gives every rank the weights and
optimizer state bit for bit, and its own extra.
"""

from __future__ import annotations

from pathlib import Path

import torch
from launch import launch

import ckptd

WORKER = Path(__file__).with_name("ddp_worker.py")


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_ddp_state_is_stored_once(daemon, job, tmp_path):
    out = tmp_path
    launch(WORKER, "save", 4, daemon.socket, job, out)
    saved = [torch.load(out / f"saved-{r}.pt") for r in range(4)]
    with ckptd.Client(daemon.socket) as c:
        [step] = c.steps(job)
    one_rank = sum(t.numel() * t.element_size() for t in saved[0]["model"].values())
    one_rank += sum(
        t.numel() * t.element_size()
        for s in saved[0]["optimizer"]["state"].values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    assert step.world_size == 4
    assert step.bytes <= 1.05 * one_rank, (step.bytes, one_rank)

    launch(WORKER, "load", 2, daemon.socket, job, out)  # the save's run loaded at 4 too
    for world in (4, 2):
        for r in range(world):
            got = torch.load(out / f"loaded-{world}-{r}.pt")
            assert same(got["model"], saved[r]["model"]), (world, r)
            assert same(got["optimizer"], saved[r]["optimizer"]), (world, r)
            assert same(got["extra"], saved[r]["extra"]), (world, r)
