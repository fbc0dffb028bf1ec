"""An HSDP job's checkpoint holds each shard once, and reshards bit for bit.

Four real processes train a model with FSDP2's hybrid sharding (a 2 x 2
CPU mesh, gloo: every shard held by two ranks) and save through
ckptd.dcp; DCP's planner gives each replicated shard to one rank, so the
step stores one copy of the state. Loading at 4 ranks (the same hybrid
mesh) and at 2 (plain FSDP) gives the saved state bit for bit. The same
through ckptd.torch.save_state_dict: a replicated piece is stored by the
replica at 0 of the replicate dimension, and the others read it there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import launch

import ckptd

WORKER = Path(__file__).with_name("hsdp_worker.py")


def tensor_bytes(tree: object) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


@pytest.mark.parametrize(
    ("save", "load", "prefix"),
    [("save", "load", ""), ("torch_save", "torch_load", "torch_")],
    ids=["ckptd.dcp", "ckptd.torch"],
)
def test_hsdp_state_is_stored_once_and_reshards(daemon, job, save, load, prefix, tmp_path):
    out = tmp_path
    launch(WORKER, save, 4, daemon.socket, job, out)
    one_copy = tensor_bytes(torch.load(out / f"{prefix}full.pt", weights_only=False))
    with ckptd.Client(daemon.socket) as c:
        [step] = c.steps(job)
    assert step.world_size == 4
    assert one_copy <= step.bytes <= 1.05 * one_copy, (step.bytes, one_copy)
    for world in (4, 2):
        launch(WORKER, load, world, daemon.socket, job, out)
        report = out / f"{prefix}load_{world}.json"
        assert json.loads(report.read_text())["diff"] == [], world
