"""What the framework workers share: a client that stops inside a save, digests, loss logs."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckptd


class PausingClient(ckptd.Client):
    """A real client that stops for good inside the save of one step, once it is staged.

    It writes marker first, for the test to kill the trainer there.
    """

    def __init__(self, pause_at: int, marker: Path) -> None:
        super().__init__()
        self.pause_at, self.marker = pause_at, marker

    def save(self, step, state, **kw):
        h = super().save(step, state, **kw)
        if step == self.pause_at:
            self.marker.write_text(str(step))
            time.sleep(3600)
        return h


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bits (a DTensor's: this rank's piece)."""
    h = hashlib.sha256()
    for tensor in tensors:
        t = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_digest(opt: torch.optim.Optimizer) -> str:
    """sha256 of every tensor of an optimizer's state, in parameter order."""
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return digest(*state)


def log_loss(path: Path, step: int, loss: torch.Tensor) -> None:
    """Append `step loss` (the loss's exact bits, as float.hex) to path."""
    with open(path, "a") as f:
        f.write(f"{step} {loss.item().hex()}\n")


def read_losses(path: Path) -> dict[int, str]:
    """What log_loss wrote: {step: loss hex}, the last line of a step winning."""
    lines = path.read_text().split("\n")
    return {int(s): v for s, v in (ln.split() for ln in lines if ln)}


def wait_paused(proc: subprocess.Popen[str], marker: Path) -> None:
    """Wait until a worker run with a PausingClient writes marker (fail if it ends first)."""
    from slow import scaled  # the tests' folder: the workers themselves never wait

    deadline = time.monotonic() + scaled(300)
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the trainer never reached the save"
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port free on the loopback now (for torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    worker: Path, sock: str, out: Path, tag: str, *args: str, world: int = 2
) -> list[subprocess.Popen[str]]:
    """Start `worker out tag args` once per rank, as torchrun would (RANK, WORLD_SIZE, ...)."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {
            **os.environ, "CKPTD_SOCKET": sock, "OMP_NUM_THREADS": "1", "RANK": str(r),
            "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }  # fmt: skip
        env.pop("CKPTD_ATTEMPT", None)  # the ranks agree on one themselves
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), str(out), tag, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def finish_ranks(procs: list[subprocess.Popen[str]]) -> None:
    """Wait for every rank; each must exit 0 (a failure shows its output)."""
    from slow import scaled

    try:
        texts = [p.communicate(timeout=scaled(600))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, text) in enumerate(zip(procs, texts, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{text}"


def kill_ranks(procs: list[subprocess.Popen[str]]) -> None:
    """SIGKILL every rank and reap it."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
