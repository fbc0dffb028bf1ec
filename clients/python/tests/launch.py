"""Starting worker processes as torchrun would, for the distributed tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def launch(worker: Path, mode: str, world: int, socket: str, job: str, out: Path) -> None:
    """Run world processes of `worker mode rank world init socket job out` and wait.

    init is a file-store path under out, one per (mode, world). Each must
    exit 0; a failure shows the rank's output.
    """
    init = out / f"store-{mode}-{world}"
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ATTEMPT"}
    env["OMP_NUM_THREADS"] = "1"
    args = [str(world), str(init), socket, job, str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), mode, str(r), *args],
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
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"{mode} rank {r} of {world} failed:\n{text}"
