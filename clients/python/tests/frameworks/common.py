"""What the framework workers share: a client that stops inside a save, digests, loss logs."""

from __future__ import annotations

import hashlib
import subprocess
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
    """sha256 of the tensors' bits."""
    h = hashlib.sha256()
    for t in tensors:
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
