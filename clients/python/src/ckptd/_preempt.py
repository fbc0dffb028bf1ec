"""Save on preemption: a signal asks the training loop to checkpoint and stop.

A scheduler about to take the nodes back says so with a signal: Slurm's
``--signal=USR1@90`` (90 s before the time limit or a preemption),
Kubernetes' and systemd's SIGTERM before their SIGKILL. Saving inside the
signal handler would run at any bytecode of the trainer -- in the middle of
an optimizer step, holding locks, between two collectives of one rank --
so the handler only sets a flag, and the loop, at a point where its state
is whole (between steps), asks ``requested()`` and saves there::

    preempt = ckptd.on_preemption()          # SIGTERM and SIGUSR1
    for step in range(start, steps):
        train_step()
        if preempt.requested():              # every rank agrees, see below
            ckptd.torch.save_state_dict(client, step, model, optimizer=opt).wait()
            break                            # exit cleanly: the step is committed

Under torch.distributed the ranks must save the same step, but the signal
reaches them at different moments (or some of them only): ``requested()``
is then a collective (an all-reduce of one flag over the group), so every
rank learns of the preemption at the same step. Call it at the same
points on every rank, as any collective.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

_Handler = Any  # what signal.signal returns: a callable, SIG_DFL, SIG_IGN or None


class Preemption:
    """Signal handlers that note a preemption, for the loop to act on; see on_preemption."""

    def __init__(self, signals: Iterable[int | str], group: Any, agree: bool | None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "on_preemption() must be called from the main thread: Python runs signal "
                "handlers there only"
            )
        self._signals = [_signal(s) for s in signals]
        if not self._signals:
            raise ValueError("on_preemption needs at least one signal (e.g. SIGTERM, SIGUSR1)")
        self._group = group
        self._agree = agree
        self._received: signal.Signals | None = None  # set by the handler, nothing else
        self._agreed = False
        self._previous: dict[signal.Signals, _Handler] = {}
        for s in self._signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No I/O, no locks, no allocation beyond this: the loop does the work.
        self._received = signal.Signals(signum)

    @property
    def signal(self) -> signal.Signals | None:
        """The signal that arrived in this process (the last one), or None."""
        return self._received

    def requested(self) -> bool:
        """Whether to checkpoint and stop now: a signal arrived (on any rank).

        With torch.distributed initialized (and agree not False), a
        collective over the group: True on every rank as soon as one of
        them got a signal, so that they all save the same step. Once True,
        it stays True (and asks no more collectives).
        """
        if self._agreed:
            return True
        mine = self._received is not None
        dist = self._dist()
        if dist is not None:
            mine = _any_rank(dist, mine, self._group)
        self._agreed = mine
        return mine

    def _dist(self) -> Any:
        if self._agree is False:
            return None
        dist: Any = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
        if self._agree:
            raise RuntimeError("on_preemption(agree=True) needs torch.distributed initialized")
        return None

    def close(self) -> None:
        """Put the signal handlers back as they were."""
        previous, self._previous = self._previous, {}
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self._signals)
        return f"Preemption(signals=[{names}], signal={self._received and self._received.name})"


def on_preemption(
    signals: Iterable[int | str] = ("SIGTERM", "SIGUSR1"),
    *,
    group: Any = None,
    agree: bool | None = None,
) -> Preemption:
    """Note SIGTERM and SIGUSR1 (or the given signals) for the loop to checkpoint on.

    The handlers only set a flag: ``requested()`` reads it at the loop's
    safe point, where the loop saves (``h.wait()`` until it commits) and
    ends. The process then exits cleanly on its own terms instead of being
    killed by the signal. Use it as a context manager, or close(), to put
    the previous handlers back.

    Args:
        signals: signal numbers or names ("SIGTERM", "USR1", signal.SIGUSR2).
        group: the torch.distributed group the ranks agree over (None: the
            default group).
        agree: True: requested() is always a collective (torch.distributed
            must be initialized); False: never (each rank alone); None: a
            collective when torch.distributed is initialized.

    Raises:
        RuntimeError: not called from the main thread.
        ValueError: an unknown signal name, or no signal.
    """
    return Preemption(signals, group, agree)


def _signal(s: int | str) -> signal.Signals:
    if isinstance(s, str):
        name = s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {s!r}") from None
    return signal.Signals(s)


def _any_rank(dist: Any, mine: bool, group: Any) -> bool:
    """Whether any rank of group has mine set: an all-reduce (MAX) of one flag."""
    torch: Any = sys.modules["torch"]  # torch.distributed is imported: so is torch
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():  # NCCL reduces CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
