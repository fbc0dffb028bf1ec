"""The ckptd client: save and load shards through the daemon's arena.

The protocol (see proto/ckptd/v1/ckptd.proto and the Go client in
clients/go/ckptd): GetArena once and map it; BeginSave with the tensor table
leases a region; the client copies each tensor straight into the region;
CommitSave returns once the daemon has journaled it. That copy is the whole
stall a trainer sees. Restores fill a region that the client copies out of
and releases. Clients that cannot map the arena stream the same bytes.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import enum
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from . import _attempt, _limits, _names, _tensors, _trust
from ._arena import Arena
from ._dataset import Dataset, make_spec
from ._errors import (
    AlreadyExistsError,
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    InvalidArgumentError,
    NotFoundError,
    SaveFailedError,
    TimeoutError,
    from_rpc_error,
)
from .v1 import ckptd_pb2 as pb
from .v1 import ckptd_pb2_grpc as pb_grpc

_RECONNECT_TIMEOUT = 30.0  # default: how long calls wait for a restarted daemon
_RECONNECT_ENV = "CKPTD_RECONNECT_TIMEOUT"
_BACKOFF = (0.05, 1.0)  # first and longest pause between tries while the daemon is away

Transport = Literal["auto", "shm", "stream"]


def default_socket() -> str:
    """The socket the daemon listens on by default.

    The same rule as ``ckptd serve`` (Go): $CKPTD_SOCKET, else ckptd.sock in
    $XDG_RUNTIME_DIR when that is set, else /tmp/ckptd-<uid>/ckptd.sock (a
    folder the daemon makes private to its user).
    """
    if s := os.environ.get("CKPTD_SOCKET"):
        return s
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.normpath(os.path.join(xdg, "ckptd.sock"))
    return f"/tmp/ckptd-{os.getuid()}/ckptd.sock"


class SaveStatus(str, enum.Enum):
    """Where an accepted save stands, as far as its handle knows."""

    STAGED = "staged"  # in the arena and journaled, waiting for a drain worker
    DRAINING = "draining"  # being compressed and written
    DURABLE = "durable"  # this rank is durable; other ranks of the step are missing
    COMMITTED = "committed"  # durable, and the step's commit record exists
    FAILED = "failed"  # the daemon gave up; wait() raises SaveFailedError


_LIVE = {
    pb.SAVE_STATE_DRAINING: SaveStatus.DRAINING,
    pb.SAVE_STATE_DURABLE: SaveStatus.DURABLE,
    pb.SAVE_STATE_COMMITTED: SaveStatus.COMMITTED,
    pb.SAVE_STATE_FAILED: SaveStatus.FAILED,
}
# States of a save the daemon has accepted (journaled) and not given up on.
_ACCEPTED = frozenset(
    {pb.SAVE_STATE_STAGED, pb.SAVE_STATE_DRAINING, pb.SAVE_STATE_DURABLE, pb.SAVE_STATE_COMMITTED}
)


@dataclass(frozen=True)
class StepInfo:
    """A committed step."""

    step: int
    world_size: int
    bytes: int  # tensor bytes over all ranks
    stored_bytes: int  # bytes in storage, after compression
    committed_at: _dt.datetime
    attempt: str = ""  # the attempt whose ranks it holds ("" from an older daemon or step)


class LoadedState(dict):  # type: ignore[type-arg]
    """The state dict a load returns, with the shard's step and metadata.

    It is a plain dict (nested as saved) plus four attributes, so code that
    only wants the tensors can ignore them.
    """

    step: int
    world_size: int
    metadata: bytes
    attempt: str  # the attempt that wrote the step ("" from an older daemon or step)


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
        self, client: Client, job: str, step: int, rank: int, *, attempt: str = ""
    ) -> None:
        self._client = client
        self.job = job
        self.step = step
        self.rank = rank
        self.attempt = attempt
        self._lock = threading.Lock()
        self._future: grpc.Future | None = None
        self._result: pb.WaitSaveResponse | None = None
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
            self._client._ensure_trusted(f"wait for {self._what()}")
        except CkptdError as e:
            self._unwatched: CkptdError | None = e
            return
        self._unwatched = None
        self._future = self._client._stub.WaitSave.future(self._request())

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
                if self._client.closed:
                    return None  # cancelled by close(): the outcome is unknown, not failed
                err = self._client._error(e, f"wait for {self._what()}")
                if isinstance(err, DaemonUnavailableError):
                    self._future, self._unwatched = None, err
                    return None
                return err
            return self._result

    def _polled(self) -> pb.WaitSaveResponse | CkptdError | None:
        """_poll, first asking the daemon again if it had gone away."""
        if self._future is None and not self._client.closed:
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
        if self._client.closed:
            return SaveStatus.STAGED  # unknown here; the daemon still has it journaled
        state = self._ask()
        return SaveStatus.STAGED if state is None else _LIVE.get(state, SaveStatus.STAGED)

    def _ask(self) -> int | None:
        """The daemon's state of the save now (WaitSave nowait); None without an answer."""
        req = self._request()
        req.nowait = True
        try:
            self._client._ensure_trusted(f"status of {self._what()}")
            return self._client._stub.WaitSave(req, timeout=5).state
        except (grpc.RpcError, CkptdError):
            return None  # the daemon is away (or untrusted); the save is journaled

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
        outage = _Outage(self._client, what)
        while True:
            r = self._poll()
            if isinstance(r, pb.WaitSaveResponse):
                return self._check(r)
            if isinstance(r, CkptdError):
                raise r
            if self._client.closed:
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
                outage = _Outage(self._client, what)  # it answers: this outage is over
            self._watch()

    def _block(self, deadline: float | None) -> None:
        """Wait for the running call to finish, up to deadline."""
        fut = self._future
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise self._timeout()
        try:
            fut.result(timeout=left)  # type: ignore[union-attr]
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


class Client:
    """A connection to one ``ckptd serve`` over its unix socket.

    Args:
        socket: the daemon's socket; default: see default_socket(). Before
            the first call the client checks the socket, its folder and the
            uid of the process behind it, and raises UntrustedDaemonError
            (sending nothing) unless they belong to this user, root or
            $CKPTD_DAEMON_UID.
        timeout: seconds allowed for each call to the daemon (None: no limit).
            A save that finds the arena full waits up to the daemon's
            --staging-wait before failing, whatever this says.
        transport: "shm" maps the arena (the fast path); "stream" sends the
            bytes over gRPC (for a client that cannot see the daemon's
            /dev/shm); "auto" maps and falls back to streaming, with a
            warning, when the arena cannot be opened.
        attempt: the run of the job this client's saves belong to, shared by
            every rank of the run and different for the next run
            ([a-z0-9._-]{1,64}, not starting with "."). Default
            $CKPTD_ATTEMPT, else a random id of this client's own, which
            suits a single rank only: ranks of one run must share an attempt
            (see the README).
        reconnect_timeout: seconds save(), load(), steps(), latest_step()
            and SaveHandle.wait() wait for a daemon that went away (a
            restart) or is not there yet, retrying, before they raise
            DaemonUnavailableError; 0 raises at once. Default
            $CKPTD_RECONNECT_TIMEOUT, else 30. Errors that mean the request
            is wrong are never retried.

    The connection is lazy: creating a client never fails because no daemon
    runs; the first call does, naming the socket. It fails at once for a
    malformed attempt or $CKPTD_DAEMON_UID. Use it as a context
    manager, or call close(). It may be shared between threads.
    """

    def __init__(
        self,
        socket: str | None = None,
        timeout: float | None = None,
        transport: Transport = "auto",
        *,
        attempt: str | None = None,
        reconnect_timeout: float | None = None,
    ) -> None:
        if transport not in ("auto", "shm", "stream"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'stream', not {transport!r}")
        self.reconnect_timeout = _reconnect_timeout(reconnect_timeout)
        self._attempt, given = _attempt.resolve(attempt)
        self._attempt_random = not given  # made up here: unknown to the other ranks
        self._warned_attempt = False
        self.socket = os.path.abspath(socket or default_socket())
        self.timeout = timeout
        self.transport: Transport = transport
        self._channel = grpc.insecure_channel(
            f"unix://{self.socket}",
            options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", _limits.MAX_MESSAGE),
                # Reconnect fast after a daemon restart; the defaults back
                # off up to two minutes.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._stub = pb_grpc.CheckpointStub(self._channel)
        self._prefetch = pb_grpc.PrefetchStub(self._channel)
        self._trusted_uids = _trust.trusted_uids()
        self._trust_lock = threading.Lock()
        self._peer: _trust.Peer | None = None  # the daemon the socket checks passed
        self._datasets: weakref.WeakSet[Dataset] = weakref.WeakSet()
        self._map_lock = threading.Lock()
        self._arena: Arena | None = None
        self._arena_id = ""
        self.closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Client(socket={self.socket!r}, transport={self.transport!r}, "
            f"attempt={self._attempt!r})"
        )

    @property
    def attempt(self) -> str:
        """The attempt this client's saves carry unless save() is given another."""
        return self._attempt

    def close(self) -> None:
        """Close the connection and unmap the arena.

        Pending saves go on in the daemon; only their handles stop working.
        """
        if self.closed:
            return
        for ds in list(self._datasets):
            ds.close()  # frees their rings in the daemon now, not after its idle timeout
        self.closed = True
        self._channel.close()
        with self._map_lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    # ---- calls ---------------------------------------------------------

    def _call(self, method: str, request: Any, what: str, stub: Any = None) -> Any:
        """One unary call with the client's timeout, errors mapped.

        It goes to the Checkpoint service unless stub names another.
        """
        if self.closed:
            raise ClientClosedError(f"{what}: the client is closed")
        self._ensure_trusted(what)
        try:
            return getattr(stub or self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self._error(e, what) from None

    def _ensure_trusted(self, what: str, recheck: bool = False) -> _trust.Peer:
        """Check the daemon behind the socket before anything is sent to it.

        The full checks (socket folder, socket, SO_PEERCRED) run before the
        first call and again whenever the socket file is another one (a
        restarted daemon, or something else in its place); otherwise this
        is one lstat. recheck runs them all (and so finds out whether a
        daemon listens at all).

        Raises:
            UntrustedDaemonError: a check failed.
            DaemonUnavailableError: no daemon is there.
        """
        peer = self._peer
        if peer is not None and not recheck:
            try:
                st = os.lstat(self.socket)
            except OSError:
                pass
            else:
                if (st.st_dev, st.st_ino) == peer.ident:
                    return peer
        with self._trust_lock:
            self._peer = None
            self._peer = _trust.check_socket(self.socket, self._trusted_uids, what)
            return self._peer

    def _error(self, err: grpc.RpcError, what: str) -> CkptdError:
        """Map a failed call; one cut short by close() is ClientClosedError."""
        if self.closed:
            return ClientClosedError(f"{what}: the client is closed")
        return from_rpc_error(err, self.socket, what)

    def _mapping(self, refresh: bool = False) -> Arena | None:
        """The arena mapping, made on first use; None when streaming.

        refresh asks the daemon again and remaps when its arena is another
        file (a restarted daemon makes a new one).
        """
        if self.transport == "stream":
            return None
        with self._map_lock:
            if self._arena is not None and not refresh:
                return self._arena
            info = self._call("GetArena", pb.GetArenaRequest(), "get the staging arena")
            if self._arena is not None:
                if info.id == self._arena_id and self._arena.is_current():
                    return self._arena
                self._arena.close()
                self._arena = None
            try:
                self._arena = Arena(info.path, info.size, self._ensure_trusted("map the arena").uid)
                self._arena_id = info.id
            except OSError as e:
                if self.transport == "shm":
                    raise CkptdError(f"cannot map the daemon's arena {info.path}: {e}") from e
                warnings.warn(
                    f"ckptd: cannot map the daemon's arena {info.path} ({e}); "
                    "streaming saves and loads over the socket instead (slower)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.transport = "stream"
                return None
            return self._arena

    def _lease_mapping(self, arena_id: str) -> Arena:
        """The mapping a lease of arena arena_id indexes, remapped if the daemon's changed.

        A daemon that restarted has a new arena file (and id); reading a
        lease's offsets in the old mapping would return stale bytes.
        """
        arena = self._mapping()
        if arena is not None and (arena_id == self._arena_id if arena_id else arena.is_current()):
            return arena
        fresh = self._mapping(refresh=True)
        if fresh is None or (arena_id and arena_id != self._arena_id):
            raise DaemonUnavailableError(
                f"the daemon's arena changed (lease in arena {arena_id!r}) and cannot be mapped"
            )
        return fresh

    # ---- datasets ------------------------------------------------------

    def dataset(
        self,
        source: str | os.PathLike[str],
        format: str = "webdataset",
        batch_size: int = 32,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        shuffle_window: int | None = None,
        skip_corrupt: bool = False,
        *,
        copy: bool = True,
        prefetch: int = 2,
    ) -> Dataset:
        """Open one rank's pass over one epoch of a dataset; iterate it for batches.

        The daemon lists the source, reads shards ahead of the trainer into
        its cache (shared by every rank on the node), cuts them into
        samples and delivers batches through ring slots in the arena. A
        batch is a list of samples; a sample is a dict with ``"__key__"``
        and one entry per extension (``"jpg"``, ``"cls"``, ...), as the
        webdataset library gives them.

        The order is a pure function of (seed, epoch, rank, world_size):
        shards are shuffled per epoch and dealt round-robin to the ranks, so
        each sample comes exactly once per epoch across all ranks, and
        samples are shuffled within a window. ``Dataset.state()`` is what to
        checkpoint; ``client.dataset(**state)`` resumes exactly.

        Args:
            source: a folder (relative paths are resolved here, not in the
                daemon), ``file:///path`` or ``s3://bucket/prefix``.
            format: "webdataset" (``.tar`` shards; a sample is the run of
                members sharing a key) or "raw" (each object one sample,
                its field named by its extension, "bin" without one).
            batch_size: samples per batch (the last one may be smaller).
            rank: this rank, in [0, world_size).
            world_size: ranks reading the dataset; shards are split among them.
            seed: the shuffling seed, the same on every rank.
            epoch: which epoch: each epoch has its own order.
            start: samples of this epoch this rank already consumed (resume).
            shuffle_window: samples shuffled together (None: the daemon's
                default, 1000; 1: shard order, no shuffling).
            skip_corrupt: skip shards that cannot be parsed, counting them
                in stats().corrupt_skipped, instead of raising.
            copy: True (default) copies each field into ``bytes`` that the
                caller owns. False gives read-only memoryviews into the
                shared-memory slot, without a copy, valid only until the
                next batch is requested (then released: using one raises
                ValueError). Numpy arrays made from them are not protected.
            prefetch: batches a background thread fetches ahead (RPC,
                decoding, copies), so that they overlap with the training
                step and next() only takes a ready batch; 0 fetches inside
                next(). With copy=False the views pin their slot, so the
                thread fetches one batch ahead at most (two ring slots
                always suffice).

        Raises:
            InvalidArgumentError: batch_size <= 0, rank outside
                [0, world_size), a source with no objects (no ``.tar``
                shards for webdataset), an unknown format or scheme.
            CorruptShardError: (while iterating) a shard cannot be parsed;
                it names the shard.
            DaemonUnavailableError: no daemon answers on the socket.
        """
        spec = make_spec(
            source, format, batch_size, rank, world_size, seed, epoch, start, shuffle_window,
            skip_corrupt,
        )  # fmt: skip
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, not {prefetch!r}")
        return Dataset(self, spec, copy=bool(copy), prefetch=prefetch)

    # ---- save ----------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        rank: int = 0,
        world_size: int = 1,
        metadata: bytes = b"",
        job: str | None = None,
        *,
        attempt: str | None = None,
    ) -> SaveHandle:
        """Stage one rank's shard of a step; return as soon as the daemon has it.

        ``state`` is a dict, possibly nested, of numpy arrays and torch tensors
        (any dtype ckptd knows, any strides, on CPU or CUDA). Each tensor is
        copied once, straight into the shared-memory region; after that the
        caller may change or free its tensors. The shard becomes durable in
        the background: see SaveHandle.wait().

        The save carries attempt (default: the client's). A step commits
        from the saves of one attempt, so every rank of world_size must save
        it under the same one; a client that made its attempt up itself
        warns, once, when it saves with world_size > 1.

        A daemon that goes away (a restart) is waited for, up to the
        client's reconnect_timeout, and the save is made again from the
        start (the lease died with the daemon). A save whose commit reached
        the daemon just before it went away is not made twice: the
        restarted daemon says it has it, and that counts as accepted.

        Raises:
            TypeError: a value or key of state cannot be stored.
            InvalidArgumentError: the step, rank, job, attempt or a name is
                refused.
            AlreadyExistsError: the step is committed, or this rank of this
                attempt is already being saved.
            ResourceExhaustedError: the arena stayed full (or is too small).
            DaemonUnavailableError: no daemon answered within reconnect_timeout.
            UntrustedDaemonError: the daemon on the socket is not trusted.
        """
        meta = _metadata_bytes(metadata)
        own = attempt is None
        attempt = self._attempt if own else _attempt.check(attempt, "attempt")
        target = _target(job, step, rank, world_size, attempt)
        if own and self._attempt_random and target.world_size > 1:
            self._warn_random_attempt(target.world_size)
        leaves = [_tensors.make_leaf(n, v) for n, v in _flatten(state)]
        size = _tensors.layout(leaves)
        table = [
            pb.Tensor(
                name=x.name, dtype=x.dtype.name, shape=x.shape, offset=x.offset, length=x.nbytes
            )
            for x in leaves
        ]
        what = f"save step {step} rank {rank}"
        outage = _Outage(self, what)
        doubt = _Doubt()
        while True:
            try:
                arena = self._mapping(refresh=outage.active)
                if arena is None:
                    resp = self._save_stream(target, table, leaves, size, meta, what, doubt)
                else:
                    resp = self._save_shm(arena, target, table, leaves, size, meta, what, doubt)
            except DaemonUnavailableError as e:
                outage.pause(e)
            except _LeaseLost as e:
                outage.pause(e.error)
            except AlreadyExistsError as e:
                verdict = self._saved_before(e, target, doubt.sent, outage.active)
                if verdict == "raise":
                    raise
                if verdict == "accepted":
                    job_name = target.job or e.metadata.get("job", "")
                    return SaveHandle(
                        self, job_name, target.step, target.rank, attempt=target.attempt
                    )
                outage.pause(e)
            else:
                t = resp.target
                return SaveHandle(self, t.job, t.step, t.rank, attempt=target.attempt)

    def _saved_before(  # noqa: PLR0911 - one answer per case of the contract
        self, err: AlreadyExistsError, target: pb.SaveTarget, in_doubt: bool, retrying: bool
    ) -> Literal["accepted", "retry", "raise"]:
        """Decide about ALREADY_EXISTS for a save, which may be the answer to our own.

        in_doubt: a commit of this save was sent and its answer lost (the
        daemon went away), so the daemon may have journaled it and, after a
        restart, replayed it. Only then can the save it reports be ours.
        """
        meta = err.metadata
        if meta.get("attempt", target.attempt) != target.attempt:
            return "raise"  # another attempt's: never ours
        if err.reason == "SAVE_IN_PROGRESS":
            if meta.get("state", "").lower() == "staging":
                # A lease not committed yet: ours from before the outage, which
                # the daemon releases when it notices the connection is gone.
                return "retry" if retrying else "raise"
            return "accepted" if in_doubt else "raise"
        if err.reason == "STEP_COMMITTED":
            # Committed from this attempt's saves, ours among them.
            return "accepted" if in_doubt and "attempt" in meta else "raise"
        if err.reason is None and in_doubt:
            # A daemon without reasons: ask it about this very save.
            probe = pb.WaitSaveRequest(
                job=target.job, step=target.step, rank=target.rank, attempt=target.attempt,
                nowait=True,
            )  # fmt: skip
            try:
                state = self._call("WaitSave", probe, "look up the save").state
            except DaemonUnavailableError:
                return "retry"  # gone again: start over, within the same bound
            except CkptdError:
                return "raise"  # it knows of no such save
            return "accepted" if state in _ACCEPTED else "raise"
        return "raise"

    def _warn_random_attempt(self, world_size: int) -> None:
        if self._warned_attempt:
            return
        self._warned_attempt = True
        warnings.warn(
            f"ckptd: saving one of {world_size} ranks under attempt {self._attempt!r}, a random "
            "id this client made up; every rank's client makes its own, and a step commits "
            f"only from the saves of one attempt. Give the ranks of a run one attempt: "
            f"{_attempt.HOWTO}, or save through ckptd.torch with torch.distributed initialized",
            RuntimeWarning,
            stacklevel=3,
        )

    def _save_shm(
        self,
        arena: Arena,
        target: pb.SaveTarget,
        table: list[pb.Tensor],
        leaves: list[_tensors.Leaf],
        size: int,
        meta: bytes,
        what: str,
        doubt: _Doubt,
    ) -> pb.CommitSaveResponse:
        del arena  # the lease says which arena it is in
        lease = self._call(
            "BeginSave", pb.BeginSaveRequest(target=target, tensors=table), what
        ).lease
        try:
            if lease.length < size:
                raise CkptdError(
                    f"{what}: daemon leased {lease.length} bytes for a {size}-byte table"
                )
            arena = self._lease_mapping(lease.arena_id)
            region = arena.region(lease.offset, size)
            _copy_leaves(leaves, region, arena.pin)
            try:
                return self._call(
                    "CommitSave", pb.CommitSaveRequest(lease_id=lease.id, metadata=meta), what
                )
            except DaemonUnavailableError as e:
                # Without a reason nobody said no: it may have been journaled.
                doubt.sent = doubt.sent or e.reason is None
                raise
            except NotFoundError as e:
                if e.reason not in (None, "UNKNOWN_LEASE"):
                    raise
                raise _LeaseLost(e) from None  # it died with a daemon (or its connection)
        except BaseException:
            # Give the region back at once rather than after --lease-timeout.
            # (A failed commit leaves nothing to abort; this then fails quietly.)
            self._abort(lease.id)
            raise

    def _abort(self, lease_id: str) -> None:
        with contextlib.suppress(grpc.RpcError, CkptdError):
            self._ensure_trusted("abort a save")
            self._stub.AbortSave(pb.AbortSaveRequest(lease_id=lease_id), timeout=5)

    def _save_stream(
        self,
        target: pb.SaveTarget,
        table: list[pb.Tensor],
        leaves: list[_tensors.Leaf],
        size: int,
        meta: bytes,
        what: str,
        doubt: _Doubt,
    ) -> pb.CommitSaveResponse:
        header = pb.SaveStreamHeader(target=target, tensors=table, metadata=meta)

        def messages() -> Iterator[pb.SaveStreamRequest]:
            yield pb.SaveStreamRequest(header=header)
            for piece in _stream_bytes(leaves, size):
                yield pb.SaveStreamRequest(data=piece)

        if self.closed:
            raise ClientClosedError(f"{what}: the client is closed")
        self._ensure_trusted(what)
        try:
            return self._stub.SaveStream(messages(), timeout=self.timeout)
        except grpc.RpcError as e:
            err = self._error(e, what)
            if isinstance(err, DaemonUnavailableError) and err.reason is None:
                doubt.sent = True  # the whole stream may have reached it
            raise err from None

    def handle(
        self, step: int, rank: int = 0, job: str | None = None, *, attempt: str | None = None
    ) -> SaveHandle:
        """A handle on a save made earlier, to wait for it.

        For another process, or a trainer that restarted, while the save was
        still draining. It follows the save of attempt (default: this
        client's; "" for whichever save of the target the daemon knows of,
        e.g. one of a previous run). wait() raises NotFoundError when the
        daemon knows of no such save and storage has none.
        """
        if attempt is None:
            attempt = self._attempt
        elif attempt:
            _attempt.check(attempt, "attempt")
        return SaveHandle(self, job or "", _int("step", step), _int("rank", rank), attempt=attempt)

    # ---- load ----------------------------------------------------------

    def load(
        self,
        step: int | None = None,
        latest: bool = False,
        rank: int = 0,
        job: str | None = None,
        *,
        as_torch: bool = False,
        device: Any = None,
        nested: bool = True,
    ) -> LoadedState:
        """Restore one rank's shard of a committed step.

        Every chunk is verified against its hash by the daemon. Tensors are
        copied once out of the shared-memory region into memory they own
        (the region is released before load returns), so they stay valid
        and writable for as long as the caller keeps them.

        Args:
            step: the step to load; or None with latest=True for the newest.
            latest: load the newest committed step.
            rank: which rank's shard.
            job: the job (None: the daemon's default).
            as_torch: return torch tensors (CPU unless device says otherwise)
                instead of numpy arrays.
            device: a torch device ("cuda:0", ...) to load straight onto;
                implies as_torch. From CUDA-registered memory this is DMA.
            nested: rebuild the nesting of the saved dict (default); False
                returns the flat tensor names as stored.

        Without as_torch, numpy arrays come back, except bfloat16 and float8
        tensors, which numpy cannot represent: they come back as torch
        tensors when torch is installed, else as their raw bits (uint16 or
        uint8 arrays).

        Returns:
            The state dict, with .step, .world_size and .metadata attributes.

        Raises:
            NotFoundError: no such committed step, or no such rank.
            DataLossError: stored data failed verification.
        """
        req = _restore_request(step, latest, rank, job)
        what = f"load {'latest step' if latest else f'step {step}'} rank {rank}"
        out = _Outputs(as_torch or device is not None, device)
        outage = _Outage(self, what)
        while True:
            try:
                arena = self._mapping(refresh=outage.active)
                if arena is None:
                    header, items = self._load_stream(req, out, what)
                else:
                    header, items = self._load_shm(req, out, what)
                break
            except DaemonUnavailableError as e:
                outage.pause(e)
            except _LeaseLost as e:
                outage.pause(e.error)
        result = LoadedState(_names.unflatten(items) if nested else dict(items))
        result.step, result.world_size, result.metadata, result.attempt = (
            header.step,
            header.world_size,
            header.metadata,
            header.attempt,
        )
        return result

    def _load_shm(
        self, req: pb.BeginRestoreRequest, out: _Outputs, what: str
    ) -> tuple[pb.RestoreHeader, list[tuple[str, Any]]]:
        resp = self._call("BeginRestore", req, what)
        release = pb.ReleaseRegionRequest(lease_id=resp.lease.id)
        try:
            header = resp.header
            arena = self._lease_mapping(resp.lease.arena_id)
            region = arena.region(resp.lease.offset, header.size)
            if out.needs_pin:
                out.pinned = arena.pin()
            items = out.build(header, region)
        except BaseException:
            # On failure the daemon reclaims the region after --lease-timeout.
            with contextlib.suppress(CkptdError):
                self._call("ReleaseRegion", release, what)
            raise
        # The copies are good only if the region stayed ours while they were
        # made: a daemon that went away meanwhile may have handed it on.
        try:
            self._call("ReleaseRegion", release, what)
        except NotFoundError as e:
            if e.reason not in (None, "UNKNOWN_LEASE"):
                raise
            raise _LeaseLost(e) from None
        return header, items

    def _load_stream(
        self, req: pb.BeginRestoreRequest, out: _Outputs, what: str
    ) -> tuple[pb.RestoreHeader, list[tuple[str, Any]]]:
        if self.closed:
            raise ClientClosedError(f"{what}: the client is closed")
        self._ensure_trusted(what)
        try:
            stream = self._stub.RestoreStream(req, timeout=self.timeout)
            first = next(stream, None)
            if first is None or not first.HasField("header"):
                raise CkptdError(f"{what}: the daemon's stream did not start with a header")
            header = first.header
            data = np.empty(header.size, np.uint8)
            n = 0
            for msg in stream:
                piece = np.frombuffer(msg.data, np.uint8)
                if n + piece.size > data.size:
                    raise CkptdError(
                        f"{what}: the daemon streamed more than the {data.size} bytes announced"
                    )
                data[n : n + piece.size] = piece
                n += piece.size
        except grpc.RpcError as e:
            raise self._error(e, what) from None
        if n != data.size:
            raise CkptdError(f"{what}: the stream ended after {n} of {data.size} bytes")
        return header, out.build(header, data)

    # ---- listing -------------------------------------------------------

    def steps(self, job: str | None = None) -> list[StepInfo]:
        """The committed steps of job (default: the daemon's), oldest first.

        Waits up to reconnect_timeout for a daemon that went away.
        """
        req = pb.ListStepsRequest(job=job or "")
        outage = _Outage(self, "list steps")
        while True:
            try:
                resp = self._call("ListSteps", req, "list steps")
                break
            except DaemonUnavailableError as e:
                outage.pause(e)
        return [
            StepInfo(
                step=s.step,
                world_size=s.world_size,
                bytes=s.bytes,
                stored_bytes=s.stored_bytes,
                committed_at=_dt.datetime.fromtimestamp(
                    s.committed_unix_nano / 1e9, tz=_dt.timezone.utc
                ),
                attempt=s.attempt,
            )
            for s in resp.steps
        ]

    def latest_step(self, job: str | None = None) -> int | None:
        """The newest committed step of job, or None when there is none (see steps())."""
        steps = self.steps(job)
        return steps[-1].step if steps else None


# ---- helpers -----------------------------------------------------------------


def _reconnect_timeout(value: float | None) -> float:
    """The argument, else $CKPTD_RECONNECT_TIMEOUT, else 30 seconds; >= 0 and finite."""
    where = "reconnect_timeout"
    if value is None:
        env = os.environ.get(_RECONNECT_ENV)
        if not env:
            return _RECONNECT_TIMEOUT
        where = f"${_RECONNECT_ENV}"
        try:
            value = float(env)
        except ValueError:
            raise InvalidArgumentError(f"{where} {env!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number of seconds, not {type(value).__name__}")
    if not 0 <= value < float("inf"):
        raise InvalidArgumentError(f"{where} {value!r} must be a finite number of seconds >= 0")
    return float(value)


class _Doubt:
    """Whether a commit of a save was sent and its answer lost (see Client.save)."""

    sent = False


class _LeaseLost(Exception):  # a signal within the client, never raised to callers
    """A lease the daemon no longer knows: it restarted (or the connection did) meanwhile."""

    def __init__(self, error: CkptdError) -> None:
        super().__init__(str(error))
        self.error = error


class _Outage:
    """One call's wait for the daemon to come back, bounded by reconnect_timeout.

    The bound runs from the first failure. Each pause backs off (50 ms
    doubling to 1 s), then waits until a trusted daemon listens on the
    socket again.
    """

    def __init__(self, client: Client, what: str) -> None:
        self.client = client
        self.what = what
        self.since: float | None = None
        self.delay = _BACKOFF[0]

    @property
    def active(self) -> bool:
        """Whether a try of this call has failed for want of a daemon."""
        return self.since is not None

    def pause(self, err: CkptdError, deadline: float | None = None) -> bool:
        """Wait before the next try.

        Returns:
            False when deadline (the caller's own) passed first, else True.

        Raises:
            DaemonUnavailableError: reconnect_timeout has passed since the
                first failure (err itself when it is 0).
            UntrustedDaemonError: what listens on the socket now is not trusted.
            ClientClosedError: the client was closed.
        """
        c = self.client
        now = time.monotonic()
        if self.since is None:
            self.since = now
        give_up = self.since + c.reconnect_timeout
        if c.closed:
            raise ClientClosedError(f"{self.what}: the client is closed") from err
        if now >= give_up:
            raise self._gone(err) from err
        end = give_up if deadline is None else min(give_up, deadline)
        while True:
            time.sleep(max(0.0, min(self.delay, end - time.monotonic())))
            self.delay = min(2 * self.delay, _BACKOFF[1])
            try:
                c._ensure_trusted(self.what, recheck=True)
                break
            except DaemonUnavailableError:
                if time.monotonic() >= end:
                    break
        # The channel reconnects by itself (backing off up to a second); a
        # try made before it has fails fast and comes back here.
        return deadline is None or time.monotonic() < deadline

    def _gone(self, err: CkptdError) -> CkptdError:
        c = self.client
        if c.reconnect_timeout == 0:
            return err
        return DaemonUnavailableError(
            f"{self.what}: no ckptd daemon answered on {c.socket} for "
            f"{c.reconnect_timeout:g}s (reconnect_timeout; last: {err.details or err}); "
            f"start it with `ckptd serve --socket {c.socket}`",
            code=err.code,
            details=err.details,
            reason=err.reason,
            metadata=err.metadata,
        )


def _flatten(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Flatten state, reporting a bad structure as InvalidArgumentError."""
    try:
        yield from _names.flatten(state)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def _metadata_bytes(metadata: Any) -> bytes:
    if isinstance(metadata, str):
        raise TypeError("metadata must be bytes, not str (encode it, e.g. metadata.encode())")
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"metadata must be bytes, not {type(metadata).__name__}")
    if len(metadata) > _limits.MAX_METADATA:
        raise InvalidArgumentError(
            f"metadata is {len(metadata)} bytes; at most {_limits.MAX_METADATA} fit in one request "
            "to the daemon (save large state as tensors instead)"
        )
    return bytes(metadata)


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    return int(v)


def _target(job: str | None, step: int, rank: int, world_size: int, attempt: str) -> pb.SaveTarget:
    """Build the save target; range checks are the daemon's, so one rule holds."""
    step, rank, world_size = _int("step", step), _int("rank", rank), _int("world_size", world_size)
    fields = (("step", step, _limits.INT64), ("rank", rank, _limits.INT32))
    for name, v, (low, high) in (*fields, ("world_size", world_size, _limits.INT32)):
        if not low <= v < high:
            raise InvalidArgumentError(f"{name} {v} is out of range")
    return pb.SaveTarget(
        job=job or "", step=step, rank=rank, world_size=world_size, attempt=attempt
    )


def _in(v: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= v < bounds[1]


def _restore_request(
    step: int | None, latest: bool, rank: int, job: str | None
) -> pb.BeginRestoreRequest:
    if latest and step is not None:
        raise ValueError("give either step or latest=True, not both")
    if not latest and step is None:
        raise ValueError("give the step to load, or latest=True")
    rank = _int("rank", rank)
    step = 0 if step is None else _int("step", step)
    if not _in(rank, _limits.INT32) or not _in(step, _limits.INT64):
        raise InvalidArgumentError(f"step {step} or rank {rank} is out of range")
    return pb.BeginRestoreRequest(job=job or "", step=step, latest=latest, rank=rank)


def _copy_leaves(leaves: list[_tensors.Leaf], region: np.ndarray, pin: Any) -> None:
    """Copy every leaf into its place in region, then wait for device copies."""
    devices = set()
    for leaf in leaves:
        if _tensors.copy_in(leaf, region[leaf.offset : leaf.offset + leaf.nbytes], pin):
            devices.add(leaf.value.device)
    if devices:
        torch = _tensors.loaded_torch()
        for d in devices:
            torch.cuda.current_stream(d).synchronize()


def _stream_bytes(leaves: list[_tensors.Leaf], size: int) -> Iterator[bytes]:
    """The region's bytes as streamed: each tensor at its offset, gaps zeroed."""
    pos = 0
    for leaf in sorted(leaves, key=lambda x: x.offset):
        if leaf.nbytes == 0:
            continue
        if leaf.offset > pos:
            yield bytes(leaf.offset - pos)
        buf = np.empty(leaf.nbytes, np.uint8)
        _tensors.copy_in(leaf, buf, lambda: False)  # unpinned: a synchronous copy
        for i in range(0, buf.size, _limits.STREAM_CHUNK):
            yield buf[i : i + _limits.STREAM_CHUNK].tobytes()
        pos = leaf.offset + leaf.nbytes
    if size > pos:  # pragma: no cover - layout never ends in a gap
        yield bytes(size - pos)


class _Outputs:
    """Builds the restored tensors in the form load was asked for."""

    def __init__(self, as_torch: bool, device: Any) -> None:
        self.torch = _tensors.torch_module() if as_torch else None
        if as_torch and self.torch is None:
            raise ImportError("load(as_torch=True) or load(device=...) needs torch installed")
        self.device = self.torch.device(device or "cpu") if self.torch is not None else None
        self.needs_pin = self.device is not None and self.device.type == "cuda"
        self.pinned = False

    def build(self, header: pb.RestoreHeader, data: np.ndarray) -> list[tuple[str, Any]]:
        items = []
        for t in header.tensors:
            dt = _tensors.BY_NAME.get(t.dtype)
            if dt is None:
                raise CkptdError(f"tensor {t.name!r} has dtype {t.dtype}, unknown to this client")
            if t.offset + t.length > data.size:
                raise CkptdError(f"tensor {t.name!r} lies outside the restored region")
            src = data[t.offset : t.offset + t.length]
            shape = tuple(t.shape)
            if self.torch is None:
                items.append((t.name, _tensors.default_out(dt, shape, src)))
            else:
                items.append(
                    (
                        t.name,
                        _tensors.torch_out(self.torch, dt, shape, src, self.device, self.pinned),
                    )
                )
        if self.pinned:
            _tensors.loaded_torch().cuda.current_stream(self.device).synchronize()
        return items
