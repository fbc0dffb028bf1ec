"""One rank of a torch.distributed run saving or loading through ckptd.dcp (test_dcp.py).

Usage: dcp_worker.py MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR

A small model (three nn.Linear layers whose sizes do not divide by 4)
sharded with FSDP2 fully_shard on a CPU mesh (gloo), with AdamW.

Beside the model and optimizer, the state dict's "extra" holds plain
(replicated) tensors of every dtype DCP plans (dtype_samples.py: 2-d,
transposed, 0-d and empty), with random bits that depend on the step.

save (WORLD 4): two optimizer steps, then dcp.save through ckptd.dcp.Writer
  (step 10); rank 0 writes the full (gathered) state to OUT_DIR/full_10.pt.
  Step 11 is named by async_save's checkpoint_id (.../step-11), as
  frameworks name it, and loaded as ckptd://<job>/latest.
  Then one more step, and dcp.async_save through a Writer (step 11): the
  full state is gathered first (full_11.pt), and after async_save returns
  the model is trained on (and the extra tensors' bits changed) before the
  future is waited for, so a staged copy that aliased the live tensors
  would show.
load (any WORLD): a differently initialised model on WORLD ranks, loaded
  from step 10 and from "latest" (11) with dcp.load through ckptd.dcp.Reader;
  rank 0 compares the gathered full state with full_<step>.pt, and every
  rank the extra tensors with the saved ones, bit for bit; rank 0 writes
  OUT_DIR/load_<WORLD>.json.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dtype_samples import dcp_samples, same_bits
from slow import scaled
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd
import ckptd.dcp
from ckptd import _tensors


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 13), torch.nn.ReLU(),
        torch.nn.Linear(13, 5),
    )  # fmt: skip
    return fsdp2(model, world), torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp2(model: torch.nn.Sequential, world: int, mesh: Any = None) -> torch.nn.Sequential:
    """Shard model with FSDP2, each Linear its own unit, over mesh.

    The default mesh is 1-D over world ranks; a 2-D (replicate, shard) mesh
    makes it hybrid (HSDP).
    """
    mesh = mesh or init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(6, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def sharded(
    model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, **({"extra": extra} if extra is not None else {})}


def full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    return {"model": msd, "optim": osd}


def diff(a: Any, b: Any, path: str = "") -> list[str]:  # noqa: PLR0911
    """Where a and b differ; tensors bit for bit (dtype, shape and bytes), NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: bytes differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {a!r} vs {b!r}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}.{i}")
        ]
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        a, b = a.getvalue(), b.getvalue()
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} vs {b!r}"]


def save(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=0)
    train(model, opt, 2, seed=1)
    written = dcp.save(
        sharded(model, opt, dcp_samples(10)), storage_writer=ckptd.dcp.Writer(client, 10, job=job)
    )
    f10 = full(model, opt)
    if rank == 0:
        torch.save(f10, out / "full_10.pt")
        assert written.storage_data, "dcp.save's metadata names where each item went"

    train(model, opt, 1, seed=2)
    f11 = full(model, opt)
    if rank == 0:
        torch.save(f11, out / "full_11.pt")
    extra = dcp_samples(11)
    fut = dcp.async_save(  # the step as frameworks give it: in DCP's checkpoint_id
        sharded(model, opt, extra),
        storage_writer=ckptd.dcp.Writer(client, job=job),
        checkpoint_id=out / "checkpoint" / "step-11",
    )
    # The staged copy is in the daemon: change the live state (no collectives
    # while the background save uses the default group: parameters by hand).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for t in extra.values():  # other bits (transposed views share a grid's bytes)
            if t.is_complex() and t.element_size() == 16:  # no integer of its width
                t.fill_(7 + 7j)
            else:
                _tensors.bits(torch, t).fill_(90)
    fut.result(timeout=scaled(300))
    steps = {s.step: s for s in client.steps(job)}
    assert steps[10].world_size == world and steps[11].world_size == world, steps


def load(rank: int, world: int, client: ckptd.Client, job: str, out: Path) -> None:
    model, opt = build(world, seed=123)
    train(model, opt, 1, seed=7)  # optimizer state exists, and differs
    report: dict[str, Any] = {}
    for step in (10, "latest"):
        sd = sharded(model, opt, dcp_samples(99))  # the same dtypes and shapes, other bits
        if step == "latest":  # the step in DCP's checkpoint_id
            reader = ckptd.dcp.Reader(client)
            dcp.load(sd, storage_reader=reader, checkpoint_id=f"ckptd://{job}/latest")
        else:
            reader = ckptd.dcp.Reader(client, step, job=job)
            dcp.load(sd, storage_reader=reader)
        assert reader.step is not None
        saved = dcp_samples(reader.step)
        wrong = [n for n, t in saved.items() if not same_bits(sd["extra"][n], t)]
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = full(model, opt)
        if rank == 0:
            want = torch.load(out / f"full_{reader.step}.pt", weights_only=False)
            report[str(step)] = {"step": reader.step, "diff": diff(want, got) + wrong}
        elif wrong:
            raise AssertionError(f"rank {rank}, step {reader.step}: {wrong} differ")
    if rank == 0:
        (out / f"load_{world}.json").write_text(json.dumps(report))


Mode = Callable[[int, int, ckptd.Client, str, Path], None]


def main(modes: dict[str, Mode] | None = None) -> None:
    """Run this rank's mode (argv: MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR)."""
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with ckptd.Client(sock) as client:
        (modes or {"save": save, "load": load})[mode](rank, world, client, job, Path(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
