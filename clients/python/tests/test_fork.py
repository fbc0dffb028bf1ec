"""The client's own HTTP/2 channel, and processes forked from a trainer.

grpcio's core hangs processes that fork (see ckptd/_h2.py), so the client
speaks gRPC over HTTP/2 itself. These tests run the same operations in the
parent and in a child forked after the parent's calls, against one real
daemon, and compare what each returned or raised; and they check what the
channel does when the daemon does not answer, goes away, or the client
closes.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from slow import scaled

import ckptd
from ckptd import _h2
from ckptd.v1 import ckptd_pb2 as pb

FORK = multiprocessing.get_context("fork")


def outcome(fn: Callable[[], Any]) -> tuple[str, ...]:
    """What fn returned, or the class, reason and message of what it raised."""
    try:
        return ("ok", repr(fn()))
    except ckptd.CkptdError as e:
        return ("error", type(e).__name__, str(e.reason), str(e))


def _child(fn: Callable[[], Any], q: Any) -> None:
    q.put(outcome(fn))


def in_child(fn: Callable[[], Any]) -> tuple[str, ...]:
    """outcome(fn) in a process forked from this one."""
    q = FORK.Queue()
    p = FORK.Process(target=_child, args=(fn, q))
    p.start()
    try:
        return q.get(timeout=scaled(60))
    finally:
        p.join(scaled(30))
        if p.is_alive():
            p.kill()


def save_and_load(sock: str, job: str, transport: str) -> list[float]:
    with ckptd.Client(sock, transport=transport) as c:  # type: ignore[arg-type]
        w = np.linspace(0, 1, 1 << 18, dtype=np.float32)
        c.save(7, {"w": w, "step": np.asarray(7)}, job=job).wait(scaled(60))
        got = c.load(7, job=job)
        assert np.array_equal(got["w"], w)
        return [float(got["w"][-1]), int(got["step"]), *(s.step for s in c.steps(job=job))]


def load_missing(sock: str, job: str) -> Any:
    with ckptd.Client(sock) as c:
        return c.load(99, job=job)


def save_bad_step(sock: str, job: str) -> Any:
    with ckptd.Client(sock) as c:
        return c.save(-1, {"w": np.zeros(4)}, job=job)


def no_daemon(sock: str) -> Any:
    with ckptd.Client(sock, reconnect_timeout=0) as c:
        return c.steps()


def test_forking_many_times_after_calls_never_hangs(daemon):
    """grpcio hung the parent in fork() or the child in its first call, under load."""
    with ckptd.Client(daemon.socket) as c:
        for _ in range(20):
            c.steps()
            assert (
                in_child(lambda: [s.step for s in ckptd.Client(daemon.socket).steps()])[0] == "ok"
            )


@pytest.mark.parametrize("transport", ["shm", "stream"])
def test_saves_and_loads_from_a_forked_child_as_from_the_parent(daemon, transport):
    ours = outcome(lambda: save_and_load(daemon.socket, f"fork-{uuid.uuid4().hex}", transport))
    child_job = f"fork-{uuid.uuid4().hex}"
    theirs = in_child(lambda: save_and_load(daemon.socket, child_job, transport))
    assert ours == theirs == ("ok", repr([1.0, 7, 7]))


@pytest.mark.parametrize("op", [load_missing, save_bad_step], ids=["missing step", "negative step"])
def test_errors_in_a_forked_child_are_the_parents(daemon, op):
    job = f"fork-{uuid.uuid4().hex}"
    ours, theirs = outcome(lambda: op(daemon.socket, job)), in_child(lambda: op(daemon.socket, job))
    assert ours[0] == "error"
    assert theirs == ours


def test_no_daemon_in_a_forked_child(tmp_path):
    sock = str(tmp_path / "none.sock")
    ours, theirs = outcome(lambda: no_daemon(sock)), in_child(lambda: no_daemon(sock))
    assert ours[:2] == theirs[:2] == ("error", "DaemonUnavailableError")


def test_the_parents_client_refuses_in_the_child(daemon):
    with ckptd.Client(daemon.socket) as c:
        c.steps()
        got = in_child(c.steps)
        assert got[:2] == ("error", "CkptdError")
        assert "before the fork" in got[3]
        c.steps()  # the parent's client goes on


@pytest.fixture
def silent(tmp_path):
    """A unix socket that accepts and never answers: a hung daemon."""
    path = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    yield path
    stop.set()
    t.join()
    for s in [*held, srv]:
        s.close()


def list_steps(ch: _h2.Channel) -> Any:
    """The channel's ListSteps call, as the generated stub makes it."""
    return ch.unary_unary(
        "/ckptd.v1.Checkpoint/ListSteps",
        request_serializer=pb.ListStepsRequest.SerializeToString,
        response_deserializer=pb.ListStepsResponse.FromString,
    )


def test_a_deadline_ends_a_call_the_daemon_never_answers(silent):
    ch = _h2.Channel(silent, 1 << 20)
    steps = list_steps(ch)
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        steps(pb.ListStepsRequest(), timeout=0.3)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t < scaled(10)
    ch.close()


def test_close_ends_a_call_in_flight(silent):
    ch = _h2.Channel(silent, 1 << 20)
    wait = ch.unary_unary(
        "/ckptd.v1.Checkpoint/WaitSave",
        request_serializer=pb.WaitSaveRequest.SerializeToString,
        response_deserializer=pb.WaitSaveResponse.FromString,
    )
    f = wait.future(pb.WaitSaveRequest(job="j", step=1))
    time.sleep(0.2)
    assert not f.done()
    ch.close()
    with pytest.raises(grpc.RpcError) as e:
        f.result(timeout=scaled(10))
    assert e.value.code() is grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError):
        wait(pb.WaitSaveRequest(job="j", step=1))  # closed: no new call either


def test_oversized_messages_are_refused_before_sending(daemon):
    ch = _h2.Channel(daemon.socket, 1 << 10)
    steps = list_steps(ch)
    with pytest.raises(grpc.RpcError) as e:
        steps(pb.ListStepsRequest(job="x" * 4096), timeout=scaled(10))
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    ch.close()


def test_one_connection_carries_concurrent_calls_and_comes_back(make_daemon):
    """As grpcio's channel: the daemon ties what a client opens to its connection."""
    d = make_daemon()
    ch = _h2.Channel(d.socket, 1 << 20)
    steps = list_steps(ch)
    steps(pb.ListStepsRequest(), timeout=scaled(10))
    first = ch._conn
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: steps(pb.ListStepsRequest(), timeout=scaled(30)), range(64)))
    assert ch._conn is first
    d.stop()
    with pytest.raises(grpc.RpcError) as e:
        steps(pb.ListStepsRequest(), timeout=scaled(10))
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    d.start()
    steps(pb.ListStepsRequest(), timeout=scaled(10))
    assert ch._conn is not first
    ch.close()
    assert ch._conn is None
    first.keeper.join(scaled(10))  # a dead connection's keeper ends by itself
    assert not first.keeper.is_alive()
