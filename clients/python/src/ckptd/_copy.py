"""Host memory copies spread over a few threads.

One thread copies about as fast as one core pulls bytes through memory; a
node's memory bandwidth is several times that, and the copy into shared
memory is the whole of a save's stall for state held in host memory. numpy
releases the GIL while it copies, so the calling thread and a few helpers
copy disjoint pieces at once.

The calling thread copies too, and pieces are small (8 MiB): a helper
descheduled on a busy core delays the save by at most the piece it holds,
and a helper that has not started by the time the pieces run out is not
waited for. Helpers are threads of this process only, made on first use
and again in a child after fork (the parent's do not exist there).

``CKPTD_COPY_THREADS`` sets the threads that copy (the caller included);
the default is this process's share of the CPUs it may run on (shared with
the node's other ranks, ``LOCAL_WORLD_SIZE`` as torchrun sets it), at most
4; 1 turns helpers off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

PIECE = 8 << 20  # bytes one thread takes at a time
SERIAL_BELOW = 32 << 20  # a smaller copy is done by the caller alone
MAX_DEFAULT_THREADS = 4

Pair = tuple[np.ndarray, np.ndarray]  # (destination, source) of np.copyto
T = TypeVar("T")


def threads() -> int:
    """The threads that copy, the caller included (at least 1)."""
    env = os.environ.get("CKPTD_COPY_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(
                f"CKPTD_COPY_THREADS must be a positive integer, got {env!r}"
            ) from None
        if n < 1:
            raise ValueError(f"CKPTD_COPY_THREADS must be a positive integer, got {n}")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1  # not ours to judge: torchrun's, and only a hint here
    return max(1, min(MAX_DEFAULT_THREADS, cpus // ranks))


class _Helpers:
    """This process's helper threads (none until a copy needs them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def pool(self, n: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size < n:
                old, self._pool, self._size = self._pool, None, n
                if old is not None:
                    old.shutdown(wait=False)  # its running pieces finish; nothing new goes in
                self._pool = ThreadPoolExecutor(n, thread_name_prefix="ckptd-copy")
            return self._pool

    def forget(self) -> None:
        """After fork: the parent's threads are not in the child."""
        self._lock = threading.Lock()
        self._pool, self._size = None, 0


_helpers = _Helpers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_helpers.forget)


def copy(pairs: Sequence[Pair]) -> None:
    """np.copyto(dst, src, casting="equiv") for every pair, on several threads if large.

    Each destination must not overlap another's or any source. The first
    error any thread hit is raised once every piece begun has ended.
    """
    n = threads()
    total = sum(int(d.nbytes) for d, _ in pairs)
    if n == 1 or total < SERIAL_BELOW:
        for dst, src in pairs:
            np.copyto(dst, src, casting="equiv")
        return
    _Copy(_pieces(pairs)).run(_helpers.pool(n - 1), n - 1)


def map_threads(fn: Callable[[int], T], n: int, nbytes: int) -> list[T]:
    """[fn(0), ..., fn(n - 1)], on the copy threads when the nbytes they read are many.

    fn must release the GIL for its work to spread (numpy, blake3 do).
    """
    workers = threads()
    if workers == 1 or n == 1 or nbytes < SERIAL_BELOW:
        return [fn(i) for i in range(n)]
    return list(_helpers.pool(workers).map(fn, range(n)))


def _pieces(pairs: Sequence[Pair]) -> Iterator[Pair]:
    """The pairs cut into pieces of about PIECE bytes where both sides are contiguous."""
    for dst, src in pairs:
        if dst.nbytes <= PIECE or not (dst.flags.c_contiguous and src.flags.c_contiguous):
            yield dst, src
            continue
        d, s = dst.reshape(-1), src.reshape(-1)
        step = max(1, PIECE // d.itemsize)
        for i in range(0, d.size, step):
            yield d[i : i + step], s[i : i + step]


class _Copy:
    """One copy's pieces, taken one at a time by whichever thread is free.

    When run returns, by an error or an interrupt too, no helper writes to
    a destination any more: the caller may give the memory back at once.
    Only helpers' pieces are counted: the caller's own copy has stopped by
    the time it can wait for theirs.
    """

    def __init__(self, pieces: Iterator[Pair]) -> None:
        self._pieces = pieces
        self._cond = threading.Condition()
        self._busy = 0  # pieces helpers are copying
        self._stopped = False
        self._error: BaseException | None = None  # the first a helper hit

    def run(self, pool: ThreadPoolExecutor, helpers: int) -> None:
        try:
            for _ in range(helpers):
                try:
                    pool.submit(self._help)
                except RuntimeError:  # the pool was replaced meanwhile: fewer helpers
                    break
            while (piece := self._take(helper=False)) is not None:
                np.copyto(piece[0], piece[1], casting="equiv")
        finally:
            self._settle()
        if self._error is not None:
            raise self._error

    def _take(self, *, helper: bool) -> Pair | None:
        with self._cond:
            if self._stopped or self._error is not None:
                return None
            piece = next(self._pieces, None)
            if piece is not None and helper:
                self._busy += 1
            return piece

    def _help(self) -> None:
        while (piece := self._take(helper=True)) is not None:
            try:
                np.copyto(piece[0], piece[1], casting="equiv")
            except BaseException as e:  # handed to the caller, which raises it
                with self._cond:
                    self._error = self._error or e
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _settle(self) -> None:
        """Hand out no more pieces and wait for the helpers' (an interrupt waits too)."""
        interrupted: BaseException | None = None
        with self._cond:
            self._stopped = True
            while self._busy:
                try:
                    self._cond.wait()
                except BaseException as e:  # a piece takes milliseconds: finish, then raise
                    interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
