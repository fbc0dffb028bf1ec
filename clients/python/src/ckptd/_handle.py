"""Handles on accepted saves: follow one to its commit (WaitSave).

A save is accepted once the daemon has journaled it; making it durable and
committing its step happen in the background. A SaveHandle is a
``concurrent.futures.Future`` of that outcome, as
``torch.distributed.checkpoint.async_save`` returns one: it starts one
WaitSave call as soon as it is made, and the call's end settles it, so
polling costs nothing, waiting only blocks, and done-callbacks and
``concurrent.futures.wait`` work without anyone polling. A daemon that goes
away meanwhile is asked again once it is back.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from ._errors import (
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    NotReplicatedWarning,
    SaveFailedError,
    TimeoutError,
    from_reason,
)
from ._transport import BACKOFF, Outage
from .v1 import ckptd_pb2 as pb

if TYPE_CHECKING:
    from ._transport import Connection

_LOG = logging.getLogger("ckptd")
_Future = concurrent.futures.Future


class SaveStatus(str, enum.Enum):
    """Where an accepted save stands, as far as its handle knows."""

    STAGED = "staged"  # in the arena and journaled, waiting for a drain worker
    DRAINING = "draining"  # being compressed and written
    DURABLE = "durable"  # this rank is durable; other ranks of the step are missing
    COMMITTED = "committed"  # durable, and the step's commit record exists
    FAILED = "failed"  # the daemon gave up; wait() raises why (see SaveHandle.wait)
    # The tiers of a step the daemon keeps in memory only (ckptd serve
    # --persist-every): where such a save ends, as a committed one ends
    # committed. HOT: in this node's memory (replicating failed, or no
    # peers); REPLICATED: also on --replicas peer nodes.
    HOT = "hot"
    REPLICATED = "replicated"


_LIVE: dict[int, SaveStatus] = {
    pb.SAVE_STATE_DRAINING: SaveStatus.DRAINING,
    pb.SAVE_STATE_DURABLE: SaveStatus.DURABLE,
    pb.SAVE_STATE_COMMITTED: SaveStatus.COMMITTED,
    pb.SAVE_STATE_FAILED: SaveStatus.FAILED,
    pb.SAVE_STATE_HOT: SaveStatus.HOT,
    pb.SAVE_STATE_REPLICATED: SaveStatus.REPLICATED,
}

# Where a save ends well: committed in storage, or kept in memory (and on
# peers) when its step is not one the daemon persists.
_ENDS = {pb.SAVE_STATE_COMMITTED, pb.SAVE_STATE_HOT, pb.SAVE_STATE_REPLICATED}


class SaveHandle(_Future[None]):
    """An accepted save, being made durable in the background.

    A ``concurrent.futures.Future`` whose result is None once the save is
    durable and its step committed, and whose exception says why not
    (the daemon gave up on it: see wait; NotFoundError when it knows of no
    such save). It settles by itself when the daemon answers:
    ``add_done_callback``, ``concurrent.futures.wait`` and ``as_completed``
    need no polling. A save cannot be taken back once staged, so
    ``cancel()`` returns False and ``cancelled()`` is always False.

    ``result(timeout)`` and ``wait(timeout)`` block alike, and raise
    ``ckptd.TimeoutError`` (a ``concurrent.futures.TimeoutError``) when
    the timeout passes first; the save goes on. Both wait for a daemon that
    restarts, up to the client's reconnect_timeout each time it goes away,
    then raise DaemonUnavailableError (and ClientClosedError once the client
    is closed) without settling the handle: the outcome is unknown, not a
    failure, and the handle follows the save again when asked.

    Attributes:
        job, step, rank: the save's target.
        attempt: the attempt it was saved under; "" asks after whichever
            save of the target the daemon knows of.
    """

    def __init__(
        self, conn: Connection, job: str, step: int, rank: int, *, attempt: str = ""
    ) -> None:
        super().__init__()
        _Future.set_running_or_notify_cancel(self)  # running from the start: never cancelled
        self._conn = conn
        self.job = job
        self.step = step
        self.rank = rank
        self.attempt = attempt
        # Guards the call and what is known about it. Reentrant: a call that
        # ends at once runs _ended inside _watch.
        self._lock = threading.RLock()
        self._call: Any = None  # the running WaitSave call (a grpc.Future)
        self._unwatched: CkptdError | None = None  # why there is no call
        self._callbacks: list[Callable[[_Future[None]], object]] = []
        self._following = False  # a thread waits for the daemon to come back
        self._delay = BACKOFF[0]
        self._ended_at = SaveStatus.COMMITTED  # the tier it ended at, once settled well
        self._not_replicated = ""  # why a save that ended HOT reached no peer; warned once
        with self._lock:
            self._watch()

    def __repr__(self) -> str:
        return (
            f"SaveHandle(job={self.job!r}, step={self.step}, rank={self.rank}, "
            f"attempt={self.attempt!r}, status={self.status.value})"
        )

    # ---- the Future interface -------------------------------------------

    def done(self) -> bool:
        """Whether the save is committed or has failed (never blocks)."""
        return self._polled()

    def running(self) -> bool:
        """Whether the save's outcome is still open (never blocks)."""
        return not self._polled()

    def cancelled(self) -> bool:
        """Always False: a staged save cannot be taken back."""
        return False

    def cancel(self) -> bool:
        """Do nothing and return False: a staged save cannot be taken back."""
        return False

    def result(self, timeout: float | None = None) -> None:
        """Block until the save is committed, as wait(timeout); None then."""
        self.wait(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block as wait(timeout); the error the save ended with, or None once committed.

        Raises:
            TimeoutError: timeout seconds passed first.
            DaemonUnavailableError, ClientClosedError, UntrustedDaemonError:
                the outcome cannot be learnt now (the handle stays open).
        """
        try:
            self.wait(timeout)
        except CkptdError:
            if not _Future.done(self):
                raise
        return _Future.exception(self, timeout=0)

    def add_done_callback(self, fn: Callable[[_Future[None]], object]) -> None:
        """Call fn(handle) once the save is settled (committed or failed).

        fn runs once, on a thread of the handle's own (never the caller's,
        never gRPC's), also when the handle is settled already; callbacks
        added before that run in the order added. An exception from fn is
        logged (logger "ckptd") and ignored, as concurrent.futures does.
        """
        with self._condition:
            if not _Future.done(self):
                self._callbacks.append(fn)
                return
        self._dispatch([fn])

    def set_result(self, result: None) -> NoReturn:
        """Refused: only the daemon's answer settles a save."""
        raise RuntimeError("a SaveHandle is settled by the daemon's answer, not by its callers")

    def set_exception(self, exception: BaseException | None) -> NoReturn:
        """Refused: only the daemon's answer settles a save."""
        raise RuntimeError("a SaveHandle is settled by the daemon's answer, not by its callers")

    # ---- ckptd's own ---------------------------------------------------

    @property
    def status(self) -> SaveStatus:
        """Where the save stands now; asks the daemon (without waiting) while it runs."""
        if not self._polled():
            return self._live_status()
        if _Future.exception(self, 0) is not None:
            return SaveStatus.FAILED
        return self._ended_at

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is durable and its step committed.

        The step commits once every rank of world_size has saved, so with
        several ranks this waits for the others too. A step the daemon keeps
        in memory only (``ckptd serve --persist-every``) is not committed:
        wait returns once the save is in the node's memory and, with peers,
        on them; ``status`` then says HOT or REPLICATED. A daemon that restarts
        meanwhile is waited for, up to the client's reconnect_timeout each
        time it goes away.

        Raises:
            AlreadyExistsError: the daemon gave up on the save because
                another run of the job committed its step after the save
                was accepted (reason ``STEP_COMMITTED``; the winner is
                ``metadata["attempt"]``), as BeginSave refuses it once
                the step is committed.
            CkptdError: the daemon gave up on the save for another reason:
                the class that reason maps to (e.g. ResourceExhaustedError
                for STORAGE_FULL), with ``reason`` and ``metadata`` set;
                SaveFailedError for a reason without a class of its own,
                or from a daemon that gives none.
            NotFoundError: the daemon knows of no such save, and storage
                has none.
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
            if self._poll():
                err = _Future.exception(self, 0)
                if err is not None:
                    raise err
                self._warn_not_replicated()
                return
            if self._conn.closed:
                raise ClientClosedError(f"{what}: the client is closed")
            with self._lock:
                call, err = self._call, self._unwatched
            if call is not None:
                self._block(call, deadline)
                continue
            if not isinstance(err, DaemonUnavailableError):
                raise err  # type: ignore[misc]  # untrusted: never retried
            if not outage.pause(err, deadline):
                raise self._timeout()
            if self._ask() is not None:
                outage = Outage(self._conn, what)  # it answers: this outage is over
            self._rewatch()

    def _warn_not_replicated(self) -> None:
        """Warn, once, that the save ended in this node's memory only."""
        with self._lock:
            why, self._not_replicated = self._not_replicated, ""
        if why:
            warnings.warn(
                f"{self._what()} is kept in this node's memory only, and lost with it: "
                f"it did not reach its peers ({why})",
                NotReplicatedWarning,
                stacklevel=3,
            )

    # ---- following the save --------------------------------------------

    def _request(self) -> pb.WaitSaveRequest:
        return pb.WaitSaveRequest(
            job=self.job, step=self.step, rank=self.rank, attempt=self.attempt
        )

    def _watch(self) -> None:
        """Start the WaitSave call (under _lock); without a trusted daemon, keep why."""
        self._call = None
        try:
            self._conn.ensure_trusted(f"wait for {self._what()}")
        except CkptdError as e:
            self._unwatched = e
            return
        self._unwatched = None
        self._call = self._conn.stub.WaitSave.future(self._request())
        self._call.add_done_callback(self._ended)

    def _rewatch(self) -> None:
        """Start a WaitSave call again unless one runs or the save is settled."""
        with self._lock:
            if self._call is None and not _Future.done(self) and not self._conn.closed:
                self._watch()

    def _poll(self) -> bool:
        """Whether the save is settled; settles it when its call has ended.

        A call cut short because the daemon went away leaves no call (and
        the reason in _unwatched): the next one goes to the daemon that
        comes back. One cut short by close() settles nothing either: the
        daemon still has the save.
        """
        if _Future.done(self):
            return True
        with self._lock:
            call = self._call
            if call is None or not call.done() or _Future.done(self):
                return _Future.done(self)
            try:
                answer = call.result()
            except grpc.RpcError as e:
                if self._conn.closed:
                    return False  # cancelled by close(): unknown, not failed
                err = self._conn.error(e, f"wait for {self._what()}")
                if isinstance(err, DaemonUnavailableError):
                    self._call, self._unwatched = None, err
                    return False
                self._settle(err)
                return True
            if answer.state in _ENDS:
                self._ended_at = _LIVE[answer.state]
                self._not_replicated = answer.replication_error
            self._settle(failure(self._what(), answer))
            return True

    def _polled(self) -> bool:
        """_poll, first asking the daemon again if it had gone away."""
        self._rewatch()
        return self._poll()

    def _settle(self, err: CkptdError | None) -> None:
        """Record the outcome (under _lock) and hand the callbacks to a thread."""
        with self._condition:
            if err is None:
                _Future.set_result(self, None)
            else:
                _Future.set_exception(self, err)
            callbacks, self._callbacks = self._callbacks, []
        if callbacks:
            self._dispatch(callbacks)

    def _ended(self, call: Any) -> None:
        """A WaitSave call ended (on gRPC's thread): settle, or follow the save again."""
        del call  # _poll looks at the current one
        try:
            if self._poll() or self._conn.closed:
                return
            with self._lock:
                if self._call is not None or self._following:
                    return
                self._following = True
            threading.Thread(
                target=self._follow, name=f"ckptd-follow-{self._what()}", daemon=True
            ).start()
        except Exception:  # on gRPC's thread: nobody else would see it
            _LOG.exception("ckptd: following %r", self)

    def _follow(self) -> None:
        """Wait (backing off) until a trusted daemon listens again, then ask it again.

        The new call's end settles the handle or starts this again. Stops
        once the save is settled, the client closed, or a call runs again
        (wait() or done() asked first).
        """
        try:
            while not _Future.done(self) and not self._conn.closed:
                with self._lock:
                    if self._call is not None:
                        return
                time.sleep(self._delay)
                self._delay = min(2 * self._delay, BACKOFF[1])
                try:
                    self._conn.ensure_trusted(f"wait for {self._what()}", recheck=True)
                except CkptdError:
                    continue  # no daemon yet (or an untrusted one): keep waiting
                with self._lock:
                    self._following = False
                    self._rewatch()
                return
        finally:
            with self._lock:
                self._following = False

    def _dispatch(self, callbacks: list[Callable[[_Future[None]], object]]) -> None:
        threading.Thread(
            target=self._run_callbacks, args=(callbacks,), name=f"ckptd-done-{self._what()}"
        ).start()

    def _run_callbacks(self, callbacks: list[Callable[[_Future[None]], object]]) -> None:
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                _LOG.exception("exception calling callback for %r", self)

    # ---- asking and blocking -------------------------------------------

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

    def _block(self, call: Any, deadline: float | None) -> None:
        """Wait for the running call to finish, up to deadline."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise self._timeout()
        try:
            call.result(timeout=left)
        except (grpc.FutureTimeoutError, concurrent.futures.TimeoutError):
            raise self._timeout() from None
        except grpc.RpcError:
            pass  # _poll maps it

    def _timeout(self) -> TimeoutError:
        return TimeoutError(f"{self._what()} not committed within the timeout; it goes on")

    def _what(self) -> str:
        job = f"job {self.job!r} " if self.job else ""
        return f"save of {job}step {self.step} rank {self.rank}"


def failure(what: str, r: pb.WaitSaveResponse) -> CkptdError | None:
    """None when WaitSave's answer says the save ended well, else the error saying how it ended.

    A failure with the daemon's reason raises what a call refused for that
    reason raises (STEP_COMMITTED: AlreadyExistsError, the committing
    attempt in its metadata), so that one except clause handles a save
    refused at once and one refused late. Older daemons send no reason:
    SaveFailedError then.
    """
    if r.state in _ENDS:
        return None
    if r.reason:
        return from_reason(what, r.reason, r.error, r.metadata, default=SaveFailedError)
    state = pb.SaveState.Name(r.state).removeprefix("SAVE_STATE_").lower()
    return SaveFailedError(f"{what} failed ({state}): {r.error}", details=r.error)
