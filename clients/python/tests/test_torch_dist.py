"""ckptd.torch under torch.distributed: the ranks of a run share one attempt.

Four real processes (gloo on the CPU, a file:// store), with no
CKPTD_ATTEMPT in their environment: rank 0 makes the attempt and
broadcasts it; a restarted run (new processes, new group) makes another.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import run_ranks

import ckptd
import ckptd.torch as ct

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 4


def run(socket: str, job: str, step: int) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-dist-"))
    args = [str(WORLD), str(tmp / "store"), socket, job, str(step), str(tmp / "out.json")]
    run_ranks(lambda r: [str(WORKER), str(r), *args], WORLD, f"step {step}", timeout=180)
    result = json.loads((tmp / "out.json").read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def test_ranks_share_the_attempt_rank_0_broadcasts(daemon, job):
    first = run(daemon.socket, job, 1)
    attempts = {r["first"] for r in first}
    assert len(attempts) == 1, first  # every rank saved under the same attempt
    [attempt] = attempts
    assert all(r["second"] == attempt for r in first)  # agreed once, reused
    assert len({r["client"] for r in first}) == WORLD  # each client's own differs
    assert attempt not in {r["client"] for r in first}
    assert all(r["warnings"] == [] for r in first)  # the shared attempt needs no warning
    with ckptd.Client(daemon.socket) as c:
        steps = {s.step: s for s in c.steps(job)}
    assert steps[1].world_size == WORLD and steps[2].world_size == WORLD

    restarted = run(daemon.socket, job, 3)  # a new run: new processes, a new group
    assert len({r["first"] for r in restarted}) == 1
    assert restarted[0]["first"] != attempt


@pytest.fixture
def group_of_one(tmp_path):
    """An in-process torch.distributed group of one rank, destroyed afterwards."""

    def init(name: str) -> None:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1
        )

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_new_process_group_agrees_on_a_new_attempt(daemon, job, group_of_one, monkeypatch):
    monkeypatch.delenv("CKPTD_ATTEMPT", raising=False)
    model = torch.nn.Linear(2, 2)
    with daemon.client() as c:
        group_of_one("a")
        a1 = ct.save_state_dict(c, 1, model, job=job).attempt
        assert a1 != c.attempt  # the run's, not the client's own
        assert ct.save_state_dict(c, 2, model, job=job).attempt == a1
        dist.destroy_process_group()
        group_of_one("b")  # an in-process restart
        a2 = ct.save_state_dict(c, 3, model, job=job).attempt
        assert a2 not in (a1, c.attempt)
        # An attempt given by the caller is used as it is.
        assert ct.save_state_dict(c, 4, model, job=job, attempt="mine").attempt == "mine"
        with daemon.client(attempt="given") as c2:
            assert ct.save_state_dict(c2, 5, model, job=job).attempt == "given"
        c.handle(5, job=job, attempt="given").wait(30)
