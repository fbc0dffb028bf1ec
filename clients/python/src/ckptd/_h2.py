"""The client's channel: gRPC calls over HTTP/2 in pure Python, fork-safe.

grpcio's core does not survive fork(), and trainers fork: torch DataLoader
workers are forked by default on Linux, anew each epoch. Here, with grpcio's
channel in use, both sides hung under load: the child's first channel
waited for ever on a lock that a thread of the parent's core held at the
fork (about one fork in twenty; CI's DataLoader test did), and the parent
itself deadlocked inside fork(), in the core's prefork handler against its
timer thread (about one in a hundred). grpcio's GRPC_ENABLE_FORK_SUPPORT
made the first worse. See grpc/grpc#13873.

So the client never starts grpcio's core. It speaks the gRPC wire protocol
with h2, python-hyper's HTTP/2 state machine, over the unix socket. Like
grpcio's channel it keeps one connection, which carries every call at once
(the daemon ties what a client opens to its connection, and releases it
when the connection closes), made again after the daemon went away. A call
waiting for an answer reads the socket itself, for every call (one at a
time holds that turn; the others wait for what it hands them), so a lone
call costs no switch between threads. Between calls a keeper thread reads
what waits every few seconds: it answers the daemon's keepalive pings
(unanswered, the daemon would cut the connection after 20 s) and notices
its going away. close() stops it; a ``.future()`` call has a thread of its
own until it ends.

Channel does what the generated stubs and the client ask of a grpc.Channel:
unary_unary (with ``.future``), unary_stream and stream_unary. A failed
call raises RpcError, a grpc.RpcError with code(), details() and the
trailing metadata that carries the daemon's google.rpc.Status, so the
client's error mapping reads it as it read grpcio's.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import os
import select
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

_WINDOW = (1 << 31) - 1  # HTTP/2's largest window: the daemon never waits on us
_KEEP = 5.0  # seconds between the keeper's reads; well within the daemon's 20 s ping timeout
_CODES = {c.value[0]: c for c in grpc.StatusCode}
# gRPC's mapping of HTTP statuses, for an answer that is not gRPC at all.
_HTTP_CODES = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}

_LIVE: weakref.WeakSet[_Conn] = weakref.WeakSet()  # this process's connections

Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None


class RpcError(grpc.RpcError):
    """A failed call, read as grpcio's are: code(), details(), trailing_metadata()."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailers: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    # grpcio's stubs type metadata as objects it never returns: Any, as grpcio's tuples.
    def trailing_metadata(self) -> Any:
        return self._trailers

    def initial_metadata(self) -> Any:
        return ()


def _closed() -> RpcError:
    return RpcError(grpc.StatusCode.CANCELLED, "Channel closed!")


def _deadline_exceeded() -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _int(text: str) -> int:
    return int(text) if text.isdigit() else -1


class _Stream:
    """What one call has received so far (guarded by its connection's lock)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.headers: list[tuple[str, str]] = []
        self.trailers: list[tuple[str, str]] = []
        self.ended = False
        self.error: RpcError | None = None

    def end(self, error: RpcError | None = None) -> None:
        if not self.ended:
            self.ended, self.error = True, error

    def message(self) -> bytes | None:
        """The next whole length-prefixed message received, taken from the buffer."""
        if len(self.buf) < 5:
            return None
        if self.buf[0] != 0:
            raise RpcError(grpc.StatusCode.INTERNAL, "a compressed message, never asked for")
        n = int.from_bytes(self.buf[1:5], "big")
        if len(self.buf) < 5 + n:
            return None
        msg = bytes(memoryview(self.buf)[5 : 5 + n])
        del self.buf[: 5 + n]
        return msg

    def status(self) -> RpcError | None:
        """The call's outcome once ended: None for OK, else its error."""
        if self.error is not None:
            return self.error
        fields = dict(self.trailers or self.headers)
        if "grpc-status" not in fields:
            http = _int(fields.get(":status", "")) if not self.trailers else 200
            code = _HTTP_CODES.get(http, grpc.StatusCode.UNKNOWN)
            if http == 200:
                code = grpc.StatusCode.INTERNAL
            return RpcError(code, f"the daemon's answer has no grpc-status (HTTP {http})")
        code = _CODES.get(_int(fields["grpc-status"]), grpc.StatusCode.UNKNOWN)
        if code is grpc.StatusCode.OK:
            if self.buf:
                return RpcError(grpc.StatusCode.INTERNAL, "the answer ended inside a message")
            return None
        details = urllib.parse.unquote(fields.get("grpc-message", ""))
        return RpcError(code, details, _metadata(self.trailers or self.headers))


def _metadata(fields: list[tuple[str, str]]) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata as grpcio gives it: -bin values decoded to bytes."""
    out: list[tuple[str, str | bytes]] = []
    for k, v in fields:
        if k.startswith(":") or k in ("grpc-status", "grpc-message", "content-type"):
            continue
        out.append((k, base64.b64decode(v + "=" * (-len(v) % 4)) if k.endswith("-bin") else v))
    return tuple(out)


def _reset(error_code: int | None) -> RpcError:
    if error_code == h2.errors.ErrorCodes.CANCEL:
        return RpcError(grpc.StatusCode.CANCELLED, "the daemon cancelled the call")
    if error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
        return RpcError(grpc.StatusCode.UNAVAILABLE, "the daemon refused the call")
    return RpcError(grpc.StatusCode.INTERNAL, f"the daemon reset the call (HTTP/2 {error_code})")


def _connect(path: str, deadline: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(None if deadline is None else max(0.001, deadline - time.monotonic()))
        sock.connect(path)
        sock.settimeout(None)
    except OSError as e:
        sock.close()
        if isinstance(e, TimeoutError):
            raise _deadline_exceeded() from None
        raise RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"failed to connect to all addresses; last error: unix:{path}: {e.strerror or e}",
        ) from None
    return sock


class _Conn:
    """One HTTP/2 connection to the daemon, carrying any number of calls at once.

    lock guards the h2 state, the streams, the reading turn and the
    socket's sending side; changed is notified whenever something arrived,
    the turn is free, or the connection died.
    """

    def __init__(self, path: str, deadline: float | None) -> None:
        self.sock = _connect(path, deadline)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                header_encoding="utf-8",
                # Our headers are constants; the daemon's are read by name only.
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
            )
        )
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.streams: dict[int, _Stream] = {}
        self.dead: RpcError | None = None
        self.reading = False  # a thread holds the turn to read the socket
        _LIVE.add(self)
        self.stop = threading.Event()
        with self.lock:
            self.h2.initiate_connection()
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW})
            self.h2.increment_flow_control_window(_WINDOW - self.h2.inbound_flow_control_window)
            self._flush()
        self.keeper = threading.Thread(target=self._keep, name="ckptd-h2-keeper", daemon=True)
        self.keeper.start()

    def _flush(self) -> None:
        """Send what h2 has queued (call with lock)."""
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def _keep(self) -> None:
        """The keeper thread: between calls, read what waits, until the connection ends."""
        while not self.stop.wait(_KEEP):
            with self.lock:
                if self.dead is not None:
                    return
                if self.reading:
                    continue
                self.reading = True
            try:
                self._read(0.0)
            finally:
                with self.lock:
                    self.reading = False
                    self.changed.notify_all()

    def _read(self, timeout: float | None) -> None:
        """Read once what arrives within timeout (None: wait) and hand it on.

        Call holding the turn, not the lock. The end of the socket, or a
        protocol error, kills the connection.
        """
        why = RpcError(grpc.StatusCode.UNAVAILABLE, "the daemon closed the connection")
        try:
            if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
                return
            data = self.sock.recv(1 << 18)
        except OSError as e:
            why, data = RpcError(grpc.StatusCode.UNAVAILABLE, f"connection: {e}"), b""
        with self.lock:
            if data:
                try:
                    self._handle(self.h2.receive_data(data))
                    self._flush()
                except (OSError, h2.exceptions.ProtocolError) as e:
                    why, data = RpcError(grpc.StatusCode.UNAVAILABLE, f"connection: {e}"), b""
            if not data:
                self._die(why)
            self.changed.notify_all()

    def _handle(self, events: list[h2.events.Event]) -> None:
        for ev in events:
            if isinstance(ev, h2.events.ConnectionTerminated):
                last = ev.last_stream_id
                for sid, st in self.streams.items():
                    if last is None or sid > last:
                        st.end(RpcError(grpc.StatusCode.UNAVAILABLE, "the daemon went away"))
                self.dead = self.dead or RpcError(grpc.StatusCode.UNAVAILABLE, "GOAWAY")
                continue
            s = self.streams.get(getattr(ev, "stream_id", None) or 0)
            if s is None:
                continue
            if isinstance(ev, h2.events.ResponseReceived):
                s.headers = list(ev.headers)  # type: ignore[arg-type]
            elif isinstance(ev, h2.events.DataReceived):
                s.buf += ev.data or b""
                self.h2.acknowledge_received_data(ev.flow_controlled_length or 0, ev.stream_id)
            elif isinstance(ev, h2.events.TrailersReceived):
                s.trailers = list(ev.headers)  # type: ignore[arg-type]
            elif isinstance(ev, h2.events.StreamEnded):
                s.end()
            elif isinstance(ev, h2.events.StreamReset):
                s.end(_reset(ev.error_code))  # after the trailers it changes nothing

    def _die(self, why: RpcError) -> None:
        """The connection is gone: every call on it ends (call with lock)."""
        self.dead = self.dead or why
        self.stop.set()  # the keeper's work is over
        for s in self.streams.values():
            s.end(why)

    def kill(self) -> None:
        """End the connection from another thread (close()): a read in progress returns."""
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def wait(self, deadline: float | None) -> None:
        """Wait for news (call with lock); DEADLINE_EXCEEDED past the deadline.

        With the turn free, this thread reads the socket itself (the lock
        released meanwhile); else it waits for the reader to hand on news.
        """
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise _deadline_exceeded()
        if self.dead is not None:
            return
        if self.reading:
            self.changed.wait(left)
            return
        self.reading = True
        self.lock.release()
        try:
            self._read(left)
        finally:
            self.lock.acquire()
            self.reading = False
            self.changed.notify_all()

    def start(
        self, path: str, timeout: float | None, deadline: float | None
    ) -> tuple[int, _Stream]:
        """Open a call's stream (call with lock), waiting while the daemon's limit is reached."""
        while True:
            if self.dead is not None:
                raise self.dead
            if self.h2.open_outbound_streams < self.h2.remote_settings.max_concurrent_streams:
                break
            self.wait(deadline)
        sid = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("user-agent", "ckptd-python-h2"),
        ]
        if timeout is not None:
            headers.append(("grpc-timeout", f"{max(1, min(int(timeout * 1000), 99999999))}m"))
        s = _Stream()
        self.streams[sid] = s
        self.h2.send_headers(sid, headers)
        self._flush()
        return sid, s

    def send(self, sid: int, s: _Stream, payload: bytes, deadline: float | None) -> None:
        """Send one message within the daemon's flow-control windows (call with lock)."""
        data = memoryview(b"\x00" + len(payload).to_bytes(4, "big") + payload)
        while data and not s.ended:
            n = min(len(data), self.h2.local_flow_control_window(sid))
            if n == 0:
                self.wait(deadline)
                continue
            while n > 0:
                k = min(n, self.h2.max_outbound_frame_size)
                self.h2.send_data(sid, data[:k].tobytes())
                data, n = data[k:], n - k
            self._flush()

    def finish(self, sid: int, s: _Stream) -> None:
        """End the call's sending side (call with lock)."""
        if not s.ended:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.h2.end_stream(sid)
                self._flush()

    def forget(self, sid: int, s: _Stream) -> None:
        """Drop a call's stream (call with lock), cancelling it if it still runs.

        A stream the daemon ended before we did (an early error) is reset
        too, or it would count against the daemon's limit of open streams.
        """
        self.streams.pop(sid, None)
        st = self.h2.streams.get(sid)
        if st is not None and not st.closed and self.dead is None:
            code = h2.errors.ErrorCodes.NO_ERROR if s.ended else h2.errors.ErrorCodes.CANCEL
            with contextlib.suppress(h2.exceptions.ProtocolError, OSError):
                self.h2.reset_stream(sid, code)
                self._flush()
        self.changed.notify_all()  # a stream slot may be free


def _forget_after_fork() -> None:
    """In a forked child, close its copies of the parent's sockets.

    The child never uses them (Channel refuses), and a copy kept open keeps
    the connection open after the parent is gone: the daemon would hold
    what the dead trainer opened until its keepalive gives up (2m20s). No
    lock is taken: a thread of the parent may have held one at the fork.
    """
    for c in list(_LIVE):
        c.dead = c.dead or RpcError(grpc.StatusCode.FAILED_PRECONDITION, "made before a fork")
        with contextlib.suppress(OSError):
            os.close(c.sock.detach())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class Channel:
    """A grpc.Channel of the calls the client makes, fork-safe (see the module)."""

    def __init__(self, path: str, max_send: int) -> None:
        self._pid = os.getpid()
        self._path = path
        self._max_send = max_send
        self._lock = threading.Lock()
        self._conn: _Conn | None = None
        self._closed = False

    def close(self) -> None:
        """Close the connection; calls in flight fail with CANCELLED.

        In a process forked from the channel's it only forgets it: the
        socket is the parent's too, and shutting it down would cut the
        parent's calls.
        """
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None and os.getpid() == self._pid:
            conn.kill()
            conn.keeper.join()

    def _connection(self, deadline: float | None) -> _Conn:
        """The live connection, made (again) when there is none."""
        if os.getpid() != self._pid:  # its connection is the parent's as well
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this channel was made in process {self._pid}, before a fork",
            )
        with self._lock:
            if self._closed:
                raise _closed()
            conn = self._conn
            if conn is not None and conn.dead is None:
                return conn
            # Connect under the lock: concurrent callers share the new connection.
            self._conn = _Conn(self._path, deadline)
            return self._conn

    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        **_: Any,
    ) -> _UnaryUnary:
        return _UnaryUnary(self, method, request_serializer, response_deserializer)

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        **_: Any,
    ) -> Callable[..., Iterator[Any]]:
        def call(request: Any, timeout: float | None = None, **_: Any) -> Iterator[Any]:
            payload = _ser(request_serializer, request)
            return self._call(method, [payload], timeout, response_deserializer)

        return call

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        **_: Any,
    ) -> Callable[..., Any]:
        def call(requests: Iterable[Any], timeout: float | None = None, **_: Any) -> Any:
            payloads = (_ser(request_serializer, r) for r in requests)
            return _one(self._call(method, payloads, timeout, response_deserializer))

        return call

    def stream_stream(self, method: str, *_: Any, **__: Any) -> Callable[..., Any]:
        def call(*_: Any, **__: Any) -> Any:
            raise RpcError(grpc.StatusCode.UNIMPLEMENTED, f"{method}: no bidirectional streams")

        return call

    def _call(
        self,
        method: str,
        payloads: Iterable[bytes],
        timeout: float | None,
        decode: Deserializer,
    ) -> Iterator[Any]:
        """One call; yields its answers as they arrive, then raises if it failed.

        A call abandoned midway (its iterator closed, or its deadline
        passed) is cancelled: the daemon sees RST_STREAM.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        c = self._connection(deadline)
        try:
            with c.lock:
                sid, s = c.start(method, timeout, deadline)
        except (OSError, h2.exceptions.ProtocolError) as e:
            raise self._broken(c, e) from None
        try:
            for p in payloads:
                if len(p) > self._max_send:
                    raise RpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Sent message larger than max ({len(p)} vs. {self._max_send})",
                    )
                with c.lock:
                    c.send(sid, s, p, deadline)
                    if s.ended:
                        break
            with c.lock:
                c.finish(sid, s)
            err: RpcError | None = None
            while True:
                with c.lock:
                    msg = s.message()
                    while msg is None and not s.ended:
                        c.wait(deadline)
                        msg = s.message()
                    if msg is None:
                        err = s.status()
                        break
                yield _decode(decode, msg)
            if err is not None:
                if self._closed and err.code() is grpc.StatusCode.UNAVAILABLE:
                    raise _closed()
                raise err
        except (OSError, h2.exceptions.ProtocolError) as e:
            raise self._broken(c, e) from None
        finally:
            with c.lock:
                c.forget(sid, s)

    def _broken(self, c: _Conn, e: Exception) -> RpcError:
        """A send failed: the connection is done for; the next call makes another."""
        err = RpcError(grpc.StatusCode.UNAVAILABLE, f"connection to the daemon: {e}")
        with c.lock:
            c._die(err)
            c.changed.notify_all()
        c.kill()
        return _closed() if self._closed else err


class _UnaryUnary:
    """A unary method: called, or started as a future (WaitSave)."""

    def __init__(self, channel: Channel, method: str, ser: Serializer, deser: Deserializer) -> None:
        self._channel, self._method, self._ser, self._deser = channel, method, ser, deser

    def __call__(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        calls = self._channel._call(self._method, [_ser(self._ser, request)], timeout, self._deser)
        return _one(calls)

    def future(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        """The call, run on a thread of its own; close() of the channel ends it."""
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        f.set_running_or_notify_cancel()

        def run() -> None:
            try:
                f.set_result(self(request, timeout))
            except RpcError as e:
                f.set_exception(e)
            except Exception as e:  # a future reports every failure
                f.set_exception(RpcError(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))

        threading.Thread(target=run, name="ckptd-h2-call", daemon=True).start()
        return f


def _ser(serializer: Serializer, request: Any) -> bytes:
    return serializer(request) if serializer is not None else bytes(request)


def _decode(decode: Deserializer, msg: bytes) -> Any:
    if decode is None:
        return msg
    try:
        return decode(msg)
    except Exception as e:  # as grpcio: a message that does not parse fails the call
        raise RpcError(grpc.StatusCode.INTERNAL, f"the daemon's answer does not parse: {e}") from e


def _one(answers: Iterator[Any]) -> Any:
    """The single answer of a call with one, its error raised."""
    out = list(answers)
    if len(out) != 1:
        raise RpcError(grpc.StatusCode.INTERNAL, f"{len(out)} answers to a unary call")
    return out[0]
