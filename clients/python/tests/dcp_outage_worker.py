"""One rank of a 4-process ckptd.dcp run that the daemon is away from (test_dcp_outage.py).

Usage: dcp_outage_worker.py RANK WORLD INIT_FILE SOCKET JOB OUT_DIR LAST_STEP

Every save goes through one Writer, its step named by DCP's checkpoint_id
(OUT_DIR/ckpt/step-N), and loads as ckptd://JOB/N. The test (pytest, the
daemon's owner) and the ranks meet through marker files in OUT_DIR: a
rank writes one when it reaches a point, and waits for the test's before
it goes on. The FSDP2 model of dcp_worker.py saves:

1. step 1, dcp.save, the daemon not up yet: rank 0 writes ``waiting-1``
   once its save has found no daemon, and the test starts it;
2. step 2, dcp.save: rank 0 writes ``staged-2`` in finish(), its shard
   copied into a held region and not committed; the test restarts the
   daemon (its way: ``stop`` or ``kill9``) and writes ``go-2``;
3. step 3, dcp.async_save, the same in the background save's finish()
   (``staged-3``, ``go-3``), while the trainer has changed its tensors;
4. step 4, dcp.async_save with the daemon stopped when it is called
   (``ready-4``; the test stops it and writes ``set-4``; rank 0 writes
   ``waiting-4`` once its staging has found no daemon; the test starts it);
5. (LAST_STEP 5) step 5 as step 3, the test setting the daemon up first
   (``ready-5``, ``set-5``).

Before steps 3 and 5 the ranks also wait for the test's ``set-N``.

Then every step that committed is loaded with dcp.load into a differently
initialised model and compared bit for bit with the state gathered at its
save. Rank 0 writes OUT_DIR/report.json: per step, the error the save
raised (or null), the copies rank 0 made into the arena, and the diff.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dcp_worker import build, diff, full, sharded, train
from slow import scaled
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_state_dict

import ckptd
import ckptd.dcp
from ckptd import _save, _transport

OUT = Path()
RANK = 0
PHASE = {"step": 0}
COPIES: dict[int, int] = {}


def mark(name: str) -> None:
    (OUT / name).write_text("")


def wait_for(name: str) -> None:
    """Wait for the test's marker file, up to a deadline."""
    limit = scaled(300)
    deadline = time.monotonic() + limit
    while not (OUT / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: no {name} from the test after {limit:.0f}s")
        time.sleep(0.02)


def instrument() -> None:
    """Rank 0: say when a save first finds no daemon, and count copies into the arena."""
    pause = _transport.Outage.pause
    copy = _save._copy_leaves
    told: set[int] = set()

    def paused(self: Any, *a: Any, **kw: Any) -> Any:
        step = PHASE["step"]
        if step not in told:
            told.add(step)
            mark(f"waiting-{step}")
        return pause(self, *a, **kw)

    def copied(*a: Any) -> Any:
        COPIES[PHASE["step"]] = COPIES.get(PHASE["step"], 0) + 1
        return copy(*a)

    _transport.Outage.pause = paused  # type: ignore[method-assign]
    _save._copy_leaves = copied


class Paused(ckptd.dcp.Writer):
    """A Writer whose coordinator stops in finish() until the test says go (steps 2, 3, 5).

    One serves every save, each naming its step in DCP's checkpoint_id.
    """

    def finish(self, metadata: Any, results: Any) -> None:
        step = PHASE["step"]
        if step in (2, 3, 5):
            mark(f"staged-{step}")
            wait_for(f"go-{step}")
        super().finish(metadata, results)


def main() -> None:
    global OUT, RANK
    rank, world, init, sock, job, out, last = sys.argv[1:8]
    RANK, OUT = int(rank), Path(out)
    world_n = int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=RANK, world_size=world_n)
    if RANK == 0:
        instrument()
    errors: dict[int, str | None] = {}
    wanted: dict[int, Any] = {}
    with ckptd.Client(sock, reconnect_timeout=scaled(120)) as client:
        model, opt = build(world_n, seed=0)

        writer = Paused(client, job=job)

        def step(n: int, how: str) -> None:
            PHASE["step"] = n
            train(model, opt, 1, seed=n)
            wanted[n] = copy.deepcopy(full(model, opt))  # step counts alias the live ones
            if n >= 3:  # the test sets the daemon up for this step
                dist.barrier()
                if RANK == 0:
                    mark(f"ready-{n}")
                wait_for(f"set-{n}")
            try:
                cid = OUT / "ckpt" / f"step-{n}"
                if how == "save":
                    dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=cid)
                else:
                    fut = dcp.async_save(
                        sharded(model, opt), storage_writer=writer, checkpoint_id=cid
                    )
                    with torch.no_grad():  # the staged copy is the daemon's
                        for p in model.parameters():
                            p.add_(1.0)
                    try:
                        fut.result(timeout=scaled(300))
                    finally:
                        with torch.no_grad():
                            for p in model.parameters():
                                p.sub_(1.0)
                errors[n] = None
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                errors[n] = f"{type(e).__name__}: {e}"
            dist.barrier()

        step(1, "save")
        step(2, "save")
        step(3, "async_save")
        step(4, "async_save")
        if last == "5":
            step(5, "async_save")

        report: dict[str, Any] = {}
        for n in sorted(wanted):
            got: list[str] | None = None
            if errors[n] is None:
                model2, opt2 = build(world_n, seed=123)
                train(model2, opt2, 1, seed=7)
                sd = sharded(model2, opt2)
                reader = ckptd.dcp.Reader(client)
                dcp.load(sd, storage_reader=reader, checkpoint_id=f"ckptd://{job}/{n}")
                msd, osd = sd["model"], sd["optim"]
                set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
                got = diff(wanted[n], full(model2, opt2))
            report[str(n)] = {"error": errors[n], "copies": COPIES.get(n, 0), "diff": got}
        if RANK == 0:
            (OUT / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
