"""One rank of test_dcp_parity.py: ckptd.dcp against DCP's FileSystemWriter, two gloo ranks.

Usage: dcp_parity_worker.py MODE RANK WORLD INIT_FILE SOCKET JOB OUT_DIR

parity: DTensors on a mesh of the two ranks (Shard(0), Shard(1), uneven,
  Replicate), a plain tensor and non-tensor values are saved through
  FileSystemWriter (dcp.save and dcp.async_save) and through ckptd.dcp
  (steps 1 and 2), and each checkpoint is loaded twice: into the same
  placements, and into others (rows into columns, replicated into
  sharded, sharded into a plain tensor and back), as DCP's own file system
  tests load with other shard plans. Rank 0 writes OUT_DIR/parity.json:
  per checkpoint and load, what differs from the saved values (gathered).
plans: dcp.save and dcp.async_save of one state layout, step after step,
  with no planner (DCP's default, whose caching ckptd.dcp.Writer turns
  on), then of another layout. Each rank counts the items of the local
  plans it gives DCP and the coordinator the global plans DCP's planner
  makes; rank 0 writes OUT_DIR/plans.json. Every step is loaded back and
  compared, bit for bit, with what was saved.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from slow import scaled
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptd
import ckptd.dcp

# name: (global shape, placement when saved, placement when loaded otherwise)
TENSORS: dict[str, tuple[tuple[int, ...], Any, Any]] = {
    "row": ((10, 20), Shard(0), Shard(1)),
    "col": ((10, 20), Shard(1), Shard(0)),
    "odd": ((7, 3), Shard(0), Replicate()),
    "rep": ((4, 5), Replicate(), Shard(0)),
    "plain": ((6,), None, Shard(0)),  # a plain tensor, loaded into a DTensor
    "full": ((9, 2), Shard(0), None),  # a DTensor, loaded into a plain tensor
}


def full_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, (shape, _, _) in TENSORS.items()}


def placed(values: dict[str, torch.Tensor], mesh: DeviceMesh, which: int) -> dict[str, Any]:
    """values as TENSORS places them when saved (which 1) or loaded otherwise (2)."""
    out: dict[str, Any] = {}
    for name, t in values.items():
        where = TENSORS[name][which]
        out[name] = t.clone() if where is None else distribute_tensor(t, mesh, [where])
    return out


def state(seed: int, mesh: DeviceMesh) -> dict[str, Any]:
    return {
        "model": placed(full_values(seed), mesh, 1),
        "extra": {"bytes0": [seed], "bytes1": f"string {seed}", "io": io.BytesIO(b"io%d" % seed),
                  "n": seed, "nested": {"l": [torch.arange(3) + seed, {"t": (seed, "x")}]}},
    }  # fmt: skip


def blank(mesh: DeviceMesh, which: int) -> dict[str, Any]:
    zeros = {n: torch.zeros(shape) for n, (shape, _, _) in TENSORS.items()}
    return {
        "model": placed(zeros, mesh, which),
        "extra": {"bytes0": [-1], "bytes1": "", "io": io.BytesIO(), "n": -1,
                  "nested": {"l": [torch.zeros(3, dtype=torch.int64), {"t": ()}]}},
    }  # fmt: skip


def differences(got: dict[str, Any], seed: int) -> list[str]:
    """What of got (gathered) differs from state(seed)."""
    want = full_values(seed)
    out = []
    for name, t in got["model"].items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if not torch.equal(whole, want[name]):
            out.append(f"model.{name}")
    extra = got["extra"]
    wanted = {"bytes0": [seed], "bytes1": f"string {seed}", "n": seed}
    out += [f"extra.{k}: {extra[k]!r}" for k, v in wanted.items() if extra[k] != v]
    if extra["io"].getvalue() != b"io%d" % seed:
        out.append(f"extra.io: {extra['io'].getvalue()!r}")
    lst = extra["nested"]["l"]
    if not torch.equal(lst[0], torch.arange(3) + seed) or lst[1]["t"] != (seed, "x"):
        out.append(f"extra.nested: {lst!r}")
    return out


def parity(rank: int, client: ckptd.Client, job: str, out: Path, mesh: DeviceMesh) -> None:
    folder = out / "fs"  # FileSystemWriter's checkpoints, beside ckptd's steps
    dcp.save(state(1, mesh), storage_writer=dcp.FileSystemWriter(folder / "1"))
    dcp.save(state(1, mesh), storage_writer=ckptd.dcp.Writer(client, 1, job=job))
    sd = state(2, mesh)
    futs = [dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(folder / "2"))]
    futs[0].result(timeout=scaled(300))  # one background save at a time, as DCP's examples
    futs.append(dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, 2, job=job)))
    for t in sd["model"].values():  # staged already: the checkpoint holds the values at the call
        (t.to_local() if isinstance(t, DTensor) else t).add_(100)
    futs[1].result(timeout=scaled(300))
    report: dict[str, list[str]] = {}
    for seed in (1, 2):
        for which in (1, 2):
            for how in ("fs", "ckptd"):
                got = blank(mesh, which)
                if how == "fs":
                    dcp.load(got, storage_reader=dcp.FileSystemReader(folder / str(seed)))
                else:
                    dcp.load(got, checkpoint_id=f"ckptd://{job}/{seed}")  # no reader: found by id
                report[f"{how} step {seed} load {which}"] = differences(got, seed)
    if rank == 0:
        (out / "parity.json").write_text(json.dumps(report))


def plans(rank: int, client: ckptd.Client, job: str, out: Path, mesh: DeviceMesh) -> None:
    made: list[int] = []  # global plans DCP's planner made (rank 0), per save
    sent: list[int] = []  # items of this rank's local plans, per save
    create_global = DefaultSavePlanner._create_global_plan
    prepare_local = ckptd.dcp.Writer.prepare_local_plan

    def counted_global(self: DefaultSavePlanner, all_plans: Any) -> Any:
        made[-1] += 1
        return create_global(self, all_plans)

    def counted_local(self: ckptd.dcp.Writer, plan: Any) -> Any:
        sent[-1] += len(plan.items)
        return prepare_local(self, plan)

    DefaultSavePlanner._create_global_plan = counted_global  # type: ignore[method-assign]
    ckptd.dcp.Writer.prepare_local_plan = counted_local  # type: ignore[method-assign]
    writer = ckptd.dcp.Writer(client, job=job)  # one for every save, the step from the id
    saved = {}
    for step in range(1, 8):
        made.append(0)
        sent.append(0)
        sd = state(step, mesh)
        if step == 7:  # another layout
            sd["extra"]["more"] = torch.ones(2)
        cid = f"ckptd://{job}/step-{step}"
        if step % 2:
            dcp.save(sd, storage_writer=writer, checkpoint_id=cid)
        else:
            dcp.async_save(sd, storage_writer=writer, checkpoint_id=cid).result(scaled(300))
        saved[step] = sd
    wrong = []
    for step in saved:
        got = blank(mesh, 1)
        if step == 7:
            got["extra"]["more"] = torch.zeros(2)
        dcp.load(got, storage_reader=ckptd.dcp.Reader(client, step, job=job))
        wrong += [f"step {step}: {d}" for d in differences(got, step)]
    if wrong:
        raise AssertionError(f"rank {rank}: {wrong}")
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, sent)
    if rank == 0:
        (out / "plans.json").write_text(json.dumps({"global": made, "local_items": counts}))


def main() -> None:
    mode, rank, world, init, sock, job, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    os.environ["CKPTD_SOCKET"] = sock  # for a ckptd:// id given without a reader
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with ckptd.Client(sock) as client:
        (parity if mode == "parity" else plans)(rank, client, job, Path(out), mesh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
