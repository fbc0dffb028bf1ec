"""Starting worker processes as torchrun would, for the distributed tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from slow import scaled


def worker_env() -> dict[str, str]:
    """The environment of a rank's process: this one's, without $CKPTD_ATTEMPT.

    One thread for torch's CPU ops (the ranks share two cores), and
    faulthandler on: a rank that dies of SIGABRT or SIGSEGV (a C++
    terminate at exit, say) prints every Python thread's stack into the
    output a failing test shows.
    """
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ATTEMPT"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def run_ranks(
    argv: Callable[[int], list[str]], world: int, what: str, timeout: float = 600
) -> None:
    """Run `python argv(rank)` for each of world ranks at once and wait.

    Each must exit 0; a failure shows the rank's output. $CKPTD_ATTEMPT is
    not passed on: the ranks agree on an attempt themselves.
    """
    env = worker_env()
    procs = [
        subprocess.Popen(
            [sys.executable, *argv(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=scaled(timeout))[0])
    finally:
        for p in procs:
            p.kill()
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"{what} rank {r} of {world} failed:\n{text}"


def launch(worker: Path, mode: str, world: int, socket: str, job: str, out: Path) -> None:
    """Run `worker mode rank world init socket job out` on world ranks and wait.

    init is a file-store path under out, one per (mode, world).
    """
    args = [str(world), str(out / f"store-{mode}-{world}"), socket, job, str(out)]
    run_ranks(lambda r: [str(worker), mode, str(r), *args], world, mode)
