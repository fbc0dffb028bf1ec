"""The connection to one daemon: channel, trust checks, arena mapping, retries, errors.

Everything the save, load, handle and dataset code sends goes through a
Connection: it checks the daemon behind the socket before the first call
(and whenever the socket file is replaced), maps the daemon's arena once,
maps failed calls to the client's exceptions, and bounds the wait for a
daemon that went away (Outage).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any, Literal

import grpc

from . import _h2, _limits, _trust
from ._arena import Arena
from ._errors import (
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    InvalidArgumentError,
    from_rpc_error,
)
from .v1 import ckptd_pb2 as pb
from .v1 import ckptd_pb2_grpc as pb_grpc

RECONNECT_TIMEOUT = 30.0  # default: how long calls wait for a restarted daemon
RECONNECT_ENV = "CKPTD_RECONNECT_TIMEOUT"
BACKOFF = (0.05, 1.0)  # first and longest pause between tries while the daemon is away

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


def check_transport(transport: object) -> Transport:
    """The transport, checked to be "auto", "shm" or "stream"."""
    if transport in ("auto", "shm", "stream"):
        return transport
    raise ValueError(f"transport must be 'auto', 'shm' or 'stream', not {transport!r}")


def resolve_reconnect_timeout(value: float | None) -> float:
    """The argument, else $CKPTD_RECONNECT_TIMEOUT, else 30 seconds; >= 0 and finite."""
    where = "reconnect_timeout"
    if value is None:
        env = os.environ.get(RECONNECT_ENV)
        if not env:
            return RECONNECT_TIMEOUT
        where = f"${RECONNECT_ENV}"
        try:
            value = float(env)
        except ValueError:
            raise InvalidArgumentError(f"{where} {env!r} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number of seconds, not {type(value).__name__}")
    if not 0 <= value < float("inf"):
        raise InvalidArgumentError(f"{where} {value!r} must be a finite number of seconds >= 0")
    return float(value)


class Connection:
    """One client's channel to one ``ckptd serve``, and its mapping of the arena.

    Args:
        socket: the daemon's socket (None: default_socket()).
        timeout: seconds allowed for each call (None: no limit).
        transport: checked with check_transport.
        reconnect_timeout: checked with reconnect_timeout().

    Raises:
        InvalidArgumentError: $CKPTD_DAEMON_UID is not a uid.
    """

    def __init__(
        self,
        socket: str | None,
        timeout: float | None,
        transport: Transport,
        reconnect_timeout: float,
    ) -> None:
        self.reconnect_timeout = reconnect_timeout
        self.socket = os.path.abspath(socket or default_socket())
        self.timeout = timeout
        self.transport: Transport = transport
        self.pid = os.getpid()
        # Not grpcio's channel, whose core hangs a process that forks (see _h2).
        self.channel = _h2.Channel(self.socket, _limits.MAX_MESSAGE)
        # The generated stubs are untyped: their calls are checked by the
        # daemon's answers, not by the type checker.
        self.stub: Any = pb_grpc.CheckpointStub(self.channel)
        self.prefetch: Any = pb_grpc.PrefetchStub(self.channel)
        self.trusted_uids = _trust.trusted_uids()
        self._trust_lock = threading.Lock()
        self._peer: _trust.Peer | None = None  # the daemon the socket checks passed
        self._map_lock = threading.Lock()
        self.arena: Arena | None = None
        self._arena_id = ""
        # The daemon's hot tier file (ArenaInfo.hot), mapped read-only on
        # the first restore in place; _hot_info is what GetArena said of it.
        self._hot_info: pb.MappedFile | None = None
        self._hot: Arena | None = None
        self._no_hot = False  # mapping the hot tier failed: restores are copied from then on
        self.closed = False

    def close(self) -> None:
        """Close the channel and unmap the arena; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.channel.close()
        with self._map_lock:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            self._drop_hot()

    def _drop_hot(self) -> None:
        """Unmap the hot tier file, if mapped. Call with _map_lock."""
        if self._hot is not None:
            self._hot.close()
            self._hot = None
        self._hot_info = None

    def call(self, method: str, request: Any, what: str, stub: Any = None) -> Any:
        """One unary call with the client's timeout, errors mapped.

        It goes to the Checkpoint service unless stub names another.
        """
        if self.closed:
            raise ClientClosedError(f"{what}: the client is closed")
        self.ensure_trusted(what)
        try:
            return getattr(stub or self.stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise self.error(e, what) from None

    def ensure_trusted(self, what: str, recheck: bool = False) -> _trust.Peer:
        """Check the daemon behind the socket before anything is sent to it.

        The full checks (socket folder, socket, SO_PEERCRED) run before the
        first call and again whenever the socket file is another one (a
        restarted daemon, or something else in its place); otherwise this
        is one lstat. recheck runs them all (and so finds out whether a
        daemon listens at all).

        Raises:
            UntrustedDaemonError: a check failed.
            DaemonUnavailableError: no daemon is there.
            CkptdError: the client was made before a fork, in the parent.
        """
        if os.getpid() != self.pid:
            raise CkptdError(
                f"{what}: this client was made in process {self.pid}, before the fork that "
                f"made this one ({os.getpid()}); its channel cannot be used here: make a "
                "new ckptd.Client in this process"
            )
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
            self._peer = _trust.check_socket(self.socket, self.trusted_uids, what)
            return self._peer

    def error(self, err: grpc.RpcError, what: str) -> CkptdError:
        """Map a failed call; one cut short by close() is ClientClosedError."""
        if self.closed:
            return ClientClosedError(f"{what}: the client is closed")
        return from_rpc_error(err, self.socket, what)

    def mapping(self, refresh: bool = False) -> Arena | None:
        """The arena mapping, made on first use; None when streaming.

        refresh asks the daemon again and remaps when its arena is another
        file (a restarted daemon makes a new one).
        """
        if self.transport == "stream":
            return None
        with self._map_lock:
            if self.arena is not None and not refresh:
                return self.arena
            info = self.call("GetArena", pb.GetArenaRequest(), "get the staging arena")
            hot = info.hot if info.HasField("hot") else None
            if self._hot_info is None or hot is None or hot.id != self._hot_info.id:
                self._drop_hot()
                self._hot_info = hot
            if self.arena is not None:
                if info.id == self._arena_id and self.arena.is_current():
                    return self.arena
                self.arena.close()
                self.arena = None
            try:
                self.arena = Arena(info.path, info.size, self.ensure_trusted("map the arena").uid)
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
            return self.arena

    @property
    def arena_id(self) -> str:
        """ArenaInfo.id of the arena mapped now ("" before the first mapping)."""
        return self._arena_id

    @property
    def in_place(self) -> bool:
        """Whether restores may be served in place: the daemon has a hot tier file to map."""
        return self._hot_info is not None and not self._no_hot and self.transport != "stream"

    def _hot_mapping(self, arena_id: str) -> Arena | None:
        """The hot tier file of id arena_id, mapped read-only on first use; else None.

        Raises:
            NotInPlace: the file cannot be mapped here; restores are
                copied into the arena from now on.
            DaemonUnavailableError: the file is not the one the daemon
                named (it restarted meanwhile).
        """
        with self._map_lock:
            info = self._hot_info
            if info is None or info.id != arena_id:
                return None
            if self._hot is None:
                uid = self.ensure_trusted("map the hot tier").uid
                try:
                    hot = Arena(info.path, info.size, uid, False)
                except OSError as e:
                    self._no_hot = True
                    warnings.warn(
                        f"ckptd: cannot map the daemon's hot tier {info.path} ({e}); "
                        "restores from it are copied into the arena instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    raise NotInPlace(str(e)) from e
                if ":".join(str(v) for v in hot.ident) != ":".join(info.id.split(":")[:2]):
                    hot.close()
                    raise DaemonUnavailableError(f"the daemon's hot tier {info.path} was made anew")
                self._hot = hot
            return self._hot

    def lease_mapping(self, arena_id: str) -> Arena:
        """The mapping a lease of arena arena_id indexes, remapped if the daemon's changed.

        A daemon that restarted has a new arena file (and id); reading a
        lease's offsets in the old mapping would return stale bytes. A
        restore in place names the hot tier file's id.
        """
        if arena_id and arena_id != self._arena_id:
            hot = self._hot_mapping(arena_id)
            if hot is not None:
                return hot
        arena = self.mapping()
        if arena is not None and (arena_id == self._arena_id if arena_id else arena.is_current()):
            return arena
        fresh = self.mapping(refresh=True)
        if fresh is not None and arena_id and arena_id != self._arena_id:
            hot = self._hot_mapping(arena_id)  # the daemon's new hot tier
            if hot is not None:
                return hot
        if fresh is None or (arena_id and arena_id != self._arena_id):
            raise DaemonUnavailableError(
                f"the daemon's arena changed (lease in arena {arena_id!r}) and cannot be mapped"
            )
        return fresh


class NotInPlace(Exception):  # a signal within the client, never raised to callers
    """A restore in place whose hot tier file cannot be mapped: make it again, copied."""


class LeaseLost(Exception):  # a signal within the client, never raised to callers
    """A lease the daemon no longer knows: it restarted (or the connection did) meanwhile."""

    def __init__(self, error: CkptdError) -> None:
        super().__init__(str(error))
        self.error = error


class Outage:
    """One call's wait for the daemon to come back, bounded by reconnect_timeout.

    The bound runs from the first failure. Each pause backs off (50 ms
    doubling to 1 s), then waits until a trusted daemon listens on the
    socket again.
    """

    def __init__(self, conn: Connection, what: str) -> None:
        self.conn = conn
        self.what = what
        self.since: float | None = None
        self.delay = BACKOFF[0]

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
        c = self.conn
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
            self.delay = min(2 * self.delay, BACKOFF[1])
            try:
                c.ensure_trusted(self.what, recheck=True)
                break
            except DaemonUnavailableError:
                if time.monotonic() >= end:
                    break
        # The channel reconnects by itself (backing off up to a second); a
        # try made before it has fails fast and comes back here.
        return deadline is None or time.monotonic() < deadline

    def _gone(self, err: CkptdError) -> CkptdError:
        c = self.conn
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
