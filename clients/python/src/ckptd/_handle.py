"""Handles on accepted saves: follow one to its commit (WaitSave).

A save is accepted once the daemon has journaled it; making it durable and
committing its step happen in the background. A SaveHandle starts one
WaitSave call as soon as it is made, so polling it costs nothing and
waiting only blocks; a daemon that restarts meanwhile is asked again.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc

from ._errors import (
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    SaveFailedError,
    TimeoutError,
)
from ._transport import Outage
from .v1 import ckptd_pb2 as pb

if TYPE_CHECKING:
    from ._transport import Connection


class SaveStatus(str, enum.Enum):
    """Where an accepted save stands, as far as its handle knows."""

    STAGED = "staged"  # in the arena and journaled, waiting for a drain worker
    DRAINING = "draining"  # being compressed and written
    DURABLE = "durable"  # this rank is durable; other ranks of the step are missing
    COMMITTED = "committed"  # durable, and the step's commit record exists
    FAILED = "failed"  # the daemon gave up; wait() raises SaveFailedError


_LIVE: dict[int, SaveStatus] = {
    pb.SAVE_STATE_DRAINING: SaveStatus.DRAINING,
    pb.SAVE_STATE_DURABLE: SaveStatus.DURABLE,
    pb.SAVE_STATE_COMMITTED: SaveStatus.COMMITTED,
    pb.SAVE_STATE_FAILED: SaveStatus.FAILED,
}


class SaveHandle:
    """An accepted save, being made durable in the background.

    The handle starts one WaitSave call as soon as the save is accepted, so
    done() and status are free to poll and wait() only blocks.

    Attributes:
        job, step, rank: the save's target.
        attempt: the attempt it was saved under; "" asks after whichever
            save of the target the daemon knows of.
    """

    def __init__(
        self, conn: Connection, job: str, step: int, rank: int, *, attempt: str = ""
    ) -> None:
        self._conn = conn
        self.job = job
        self.step = step
        self.rank = rank
        self.attempt = attempt
        self._lock = threading.Lock()
        self._future: Any = None  # the WaitSave call (a grpc.Future)
        self._result: pb.WaitSaveResponse | None = None
        self._unwatched: CkptdError | None = None
        self._watch()

    def __repr__(self) -> str:
        return (
            f"SaveHandle(job={self.job!r}, step={self.step}, rank={self.rank}, "
            f"attempt={self.attempt!r}, status={self.status.value})"
        )

    def _request(self) -> pb.WaitSaveRequest:
        return pb.WaitSaveRequest(
            job=self.job, step=self.step, rank=self.rank, attempt=self.attempt
        )

    def _watch(self) -> None:
        """Start the WaitSave call; without a trusted daemon, keep why for wait()."""
        self._future = None
        try:
            self._conn.ensure_trusted(f"wait for {self._what()}")
        except CkptdError as e:
            self._unwatched = e
            return
        self._unwatched = None
        self._future = self._conn.stub.WaitSave.future(self._request())

    def _poll(self) -> pb.WaitSaveResponse | CkptdError | None:
        """The finished call's answer or error, or None while it runs.

        A call cut short because the daemon went away leaves no call (and
        the reason in _unwatched): the next one goes to the daemon that
        comes back.
        """
        with self._lock:
            if self._result is not None:
                return self._result
            fut = self._future
            if fut is None or not fut.done():
                return None
            try:
                self._result = fut.result()
            except grpc.RpcError as e:
                if self._conn.closed:
                    return None  # cancelled by close(): the outcome is unknown, not failed
                err = self._conn.error(e, f"wait for {self._what()}")
                if isinstance(err, DaemonUnavailableError):
                    self._future, self._unwatched = None, err
                    return None
                return err
            return self._result

    def _polled(self) -> pb.WaitSaveResponse | CkptdError | None:
        """_poll, first asking the daemon again if it had gone away."""
        if self._future is None and not self._conn.closed:
            with self._lock:
                if self._future is None and self._result is None:
                    self._watch()
        return self._poll()

    def done(self) -> bool:
        """Whether the save is committed or has failed (never blocks)."""
        return self._polled() is not None

    @property
    def status(self) -> SaveStatus:
        """Where the save stands now; asks the daemon (without waiting) while it runs."""
        r = self._polled()
        if r is None:
            return self._live_status()
        if isinstance(r, pb.WaitSaveResponse) and r.state == pb.SAVE_STATE_COMMITTED:
            return SaveStatus.COMMITTED
        return SaveStatus.FAILED

    def _live_status(self) -> SaveStatus:
        if self._conn.closed:
            return SaveStatus.STAGED  # unknown here; the daemon still has it journaled
        state = self._ask()
        return SaveStatus.STAGED if state is None else _LIVE.get(state, SaveStatus.STAGED)

    def _ask(self) -> int | None:
        """The daemon's state of the save now (WaitSave nowait); None without an answer."""
        req = self._request()
        req.nowait = True
        try:
            self._conn.ensure_trusted(f"status of {self._what()}")
            state: int = self._conn.stub.WaitSave(req, timeout=5).state
        except (grpc.RpcError, CkptdError):
            return None  # the daemon is away (or untrusted); the save is journaled
        return state

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is durable and its step committed.

        The step commits once every rank of world_size has saved, so with
        several ranks this waits for the others too. A daemon that restarts
        meanwhile is waited for, up to the client's reconnect_timeout each
        time it goes away.

        Raises:
            SaveFailedError: the daemon gave up on the save (it says why).
            TimeoutError: timeout seconds passed first; the save goes on and
                wait can be called again.
            DaemonUnavailableError: the daemon went away and did not come
                back within the client's reconnect_timeout.
            UntrustedDaemonError: what came back on the socket is not trusted.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        what = f"wait for {self._what()}"
        outage = Outage(self._conn, what)
        while True:
            r = self._poll()
            if isinstance(r, pb.WaitSaveResponse):
                return self._check(r)
            if isinstance(r, CkptdError):
                raise r
            if self._conn.closed:
                raise ClientClosedError(f"{what}: the client is closed")
            if self._future is not None:
                self._block(deadline)
                continue
            err = self._unwatched
            if not isinstance(err, DaemonUnavailableError):
                raise err  # type: ignore[misc]  # untrusted: never retried
            if not outage.pause(err, deadline):
                raise self._timeout()
            if self._ask() is not None:
                outage = Outage(self._conn, what)  # it answers: this outage is over
            self._watch()

    def _block(self, deadline: float | None) -> None:
        """Wait for the running call to finish, up to deadline."""
        fut = self._future
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise self._timeout()
        try:
            fut.result(timeout=left)
        except grpc.FutureTimeoutError:
            raise self._timeout() from None
        except grpc.RpcError:
            pass  # _poll maps it

    def _timeout(self) -> TimeoutError:
        return TimeoutError(f"{self._what()} not committed within the timeout; it goes on")

    def _check(self, r: pb.WaitSaveResponse) -> None:
        if r.state != pb.SAVE_STATE_COMMITTED:
            state = pb.SaveState.Name(r.state).removeprefix("SAVE_STATE_").lower()
            raise SaveFailedError(f"{self._what()} failed ({state}): {r.error}", details=r.error)

    def _what(self) -> str:
        job = f"job {self.job!r} " if self.job else ""
        return f"save of {job}step {self.step} rank {self.rank}"
