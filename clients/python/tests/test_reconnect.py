"""A daemon restart does not kill training: calls wait for it and retry, within a bound.

Each point a restart can hit a save is played against a real daemon:
before BeginSave, between BeginSave and CommitSave, and after CommitSave
was journaled but before its answer arrived. The daemon's structured
answers (ErrorInfo reasons) are played by a stand-in stub.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from rpcerrors import rpc_error

import ckptd
from ckptd import _load, _save
from ckptd.v1 import ckptd_pb2 as pb

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS


def restart_soon(d, after: float = 1.0) -> threading.Thread:
    """Start d again after a while, from another thread (the call under test blocks)."""
    t = threading.Thread(target=lambda: (time.sleep(after), d.start()))
    t.start()
    return t


def counted_copies(monkeypatch, before=None) -> list[int]:
    """Count the copies into the arena; before(n) runs ahead of copy n."""
    copies: list[int] = []
    real = _save._copy_leaves

    def copy(*a):
        copies.append(1)
        if before is not None:
            before(len(copies))
        return real(*a)

    monkeypatch.setattr(_save, "_copy_leaves", copy)
    return copies


def test_reconnect_timeout_setting(monkeypatch):
    monkeypatch.delenv("CKPTD_RECONNECT_TIMEOUT", raising=False)
    assert ckptd.Client("/x.sock").reconnect_timeout == 30.0
    monkeypatch.setenv("CKPTD_RECONNECT_TIMEOUT", "2.5")
    assert ckptd.Client("/x.sock").reconnect_timeout == 2.5
    assert ckptd.Client("/x.sock", reconnect_timeout=0).reconnect_timeout == 0.0  # argument wins
    monkeypatch.setenv("CKPTD_RECONNECT_TIMEOUT", "soon")
    with pytest.raises(ckptd.InvalidArgumentError, match=r"\$CKPTD_RECONNECT_TIMEOUT 'soon'"):
        ckptd.Client("/x.sock")
    monkeypatch.delenv("CKPTD_RECONNECT_TIMEOUT")
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ckptd.InvalidArgumentError, match="reconnect_timeout"):
            ckptd.Client("/x.sock", reconnect_timeout=bad)


def test_calls_wait_for_a_restarted_daemon(make_daemon, job):
    d = make_daemon()
    with d.client(reconnect_timeout=30) as c:
        c.save(1, {"w": np.full(8, 1.0)}, job=job).wait(30)
        for call in (
            lambda: c.save(2, {"w": np.full(8, 2.0)}, job=job).wait(30),  # before BeginSave
            lambda: c.load(2, job=job),
            lambda: c.steps(job),
            lambda: c.latest_step(job),
        ):
            d.stop()
            t = restart_soon(d)
            t0 = time.monotonic()
            call()
            assert time.monotonic() - t0 > 0.5  # it did wait for the restart
            t.join()
        assert c.load(2, job=job)["w"][0] == 2.0
        assert c.latest_step(job) == 2


def test_a_daemon_that_never_comes_back(make_daemon, job):
    d = make_daemon()
    with d.client(reconnect_timeout=1) as c:
        c.steps(job)
        d.stop()
        for call in (lambda: c.save(1, {"w": np.zeros(1)}, job=job), lambda: c.load(1, job=job)):
            t0 = time.monotonic()
            with pytest.raises(ckptd.DaemonUnavailableError) as e:
                call()
            assert 1.0 <= time.monotonic() - t0 < 10
            assert d.socket in str(e.value) and "for 1s (reconnect_timeout" in str(e.value)
            assert "ckptd serve --socket" in str(e.value)
    with d.client(reconnect_timeout=0) as c:  # 0: at once, as before
        t0 = time.monotonic()
        with pytest.raises(ckptd.DaemonUnavailableError, match="no ckptd daemon answers"):
            c.steps(job)
        assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_restart_between_begin_and_commit_redoes_the_save(make_daemon, job, monkeypatch, how):
    """The lease died with the daemon: the save is made again, into the new arena."""
    d = make_daemon()

    def restart(n: int) -> None:
        if n == 1:
            getattr(d, how)()
            d.start()

    with d.client() as c:
        c.steps(job)
        copies = counted_copies(monkeypatch, restart)
        h = c.save(1, {"w": np.arange(1000, dtype=np.int64)}, job=job)
        assert len(copies) == 2  # copied again after the restart
        h.wait(30)
        assert np.array_equal(c.load(1, job=job)["w"], np.arange(1000))


@pytest.mark.parametrize(
    ("journaled", "copies_made"),
    [
        (True, 1),  # the daemon took the commit: its successor has the save, not saved twice
        (False, 2),  # it died before journaling it: the save is made again
    ],
)
def test_commit_whose_answer_is_lost(make_daemon, job, monkeypatch, journaled, copies_made):
    d = make_daemon()
    with d.client() as c:
        c.steps(job)
        copies = counted_copies(monkeypatch)
        commit = c._conn.stub.CommitSave

        def commit_lost(req, **kw):
            if journaled:
                commit(req, **kw)
            d.kill9()
            d.start()  # replays the journal
            c._conn.stub.CommitSave = commit
            raise rpc_error(UNAVAILABLE, "Socket closed")

        c._conn.stub.CommitSave = commit_lost
        h = c.save(1, {"w": np.full(64, 3, np.int32)}, job=job)
        assert len(copies) == copies_made
        assert h.attempt == c.attempt
        h.wait(30)
        assert c.load(1, job=job)["w"][0] == 3


def test_load_whose_region_was_lost_while_copying_is_made_again(make_daemon, job, monkeypatch):
    """The daemon went away mid-copy: the region may have been handed on, so load again."""
    d = make_daemon()
    with d.client() as c:
        c.save(1, {"w": np.arange(4096, dtype=np.int64)}, job=job).wait(30)
        builds = []
        real = _load._Outputs.build

        def build(self, header, data):
            builds.append(1)
            if len(builds) == 1:
                d.kill9()
                d.start()
            return real(self, header, data)

        monkeypatch.setattr(_load._Outputs, "build", build)
        assert np.array_equal(c.load(1, job=job)["w"], np.arange(4096))
        assert len(builds) == 2


def test_wait_gives_up_then_follows_the_save_again(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    with d.client(reconnect_timeout=1) as c:
        h = c.save(1, {"w": np.full(16, 5, np.int32)}, job=job)
        d.kill9()  # accepted and journaled, not durable
        with pytest.raises(ckptd.DaemonUnavailableError, match="reconnect_timeout"):
            h.wait(60)
        assert not h.done()  # unknown, not failed
        d.start()
        h.wait(60)
        assert h.status == ckptd.SaveStatus.COMMITTED


# ---- the daemon's reasons, played by a stand-in stub ------------------------


class Done(futures.Future):
    def __init__(self, result) -> None:
        super().__init__()
        self.set_result(result)


class CommittedWait:
    """WaitSave, unary and as a future: always COMMITTED."""

    def __call__(self, req, **kw):
        return pb.WaitSaveResponse(state=pb.SAVE_STATE_COMMITTED)

    def future(self, req, **kw):
        return Done(self(req))


class FakeStub:
    """SaveStream answers from a script; WaitSave says COMMITTED."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.WaitSave = CommittedWait()

    def SaveStream(self, messages, **kw):
        self.calls += 1
        for _ in messages:
            pass
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def staged_client(daemon, stub: FakeStub, **kw) -> ckptd.Client:
    c = daemon.client(transport="stream", attempt="run-1", **kw)
    c._conn.stub = stub
    return c


def in_progress(attempt: str = "run-1", state: str = "staged") -> grpc.RpcError:
    return rpc_error(
        ALREADY_EXISTS,
        "already being saved",
        "SAVE_IN_PROGRESS",
        {"job": "j", "step": "1", "rank": "0", "attempt": attempt, "state": state},
    )


def test_save_in_progress_for_our_attempt_after_a_lost_commit_is_accepted(daemon):
    stub = FakeStub(rpc_error(UNAVAILABLE, "Socket closed"), in_progress())
    with staged_client(daemon, stub) as c:
        h = c.save(1, {"a": np.zeros(1)}, job="j")
        assert stub.calls == 2
        assert (h.job, h.step, h.rank, h.attempt) == ("j", 1, 0, "run-1")
        h.wait(5)


def test_save_in_progress_without_a_lost_commit_is_raised(daemon):
    with staged_client(daemon, FakeStub(in_progress())) as c:
        with pytest.raises(ckptd.AlreadyExistsError) as e:
            c.save(1, {"a": np.zeros(1)}, job="j")
        assert e.value.reason == "SAVE_IN_PROGRESS"


def test_another_attempts_save_or_commit_is_raised_even_after_a_lost_commit(daemon):
    committed = rpc_error(
        ALREADY_EXISTS, "step 1 committed by old-run", "STEP_COMMITTED", {"attempt": "old-run"}
    )
    for answer in (in_progress(attempt="old-run"), committed):
        stub = FakeStub(rpc_error(UNAVAILABLE, "Socket closed"), answer)
        with staged_client(daemon, stub) as c, pytest.raises(ckptd.AlreadyExistsError) as e:
            c.save(1, {"a": np.zeros(1)}, job="j")
        assert e.value.metadata["attempt"] == "old-run"


def test_step_committed_by_our_own_attempt_after_a_lost_commit_is_accepted(daemon):
    committed = rpc_error(ALREADY_EXISTS, "committed", "STEP_COMMITTED", {"attempt": "run-1"})
    stub = FakeStub(rpc_error(UNAVAILABLE, "Socket closed"), committed)
    with staged_client(daemon, stub) as c:
        c.save(1, {"a": np.zeros(1)}, job="j").wait(5)


def test_our_own_uncommitted_lease_is_waited_out(daemon):
    """SAVE_IN_PROGRESS in state staging: the old lease is still being released."""
    ok = pb.CommitSaveResponse(target=pb.SaveTarget(job="j", step=1, rank=0, attempt="run-1"))
    stub = FakeStub(rpc_error(UNAVAILABLE, "Socket closed"), in_progress(state="staging"), ok)
    with staged_client(daemon, stub) as c:
        c.save(1, {"a": np.zeros(1)}, job="j").wait(5)
        assert stub.calls == 3


def _answer(code: str, reason: str) -> grpc.RpcError:
    return rpc_error(getattr(grpc.StatusCode, code), f"{reason} happened", reason)


@pytest.mark.parametrize(
    ("answer", "cls"),
    [
        (_answer("INVALID_ARGUMENT", "INVALID"), ckptd.InvalidArgumentError),
        (_answer("UNAVAILABLE", "STORAGE_UNAVAILABLE"), ckptd.StorageUnavailableError),
        (_answer("RESOURCE_EXHAUSTED", "ARENA_FULL"), ckptd.ResourceExhaustedError),
        (_answer("PERMISSION_DENIED", "PERMISSION_DENIED"), ckptd.PermissionDeniedError),
        (_answer("ALREADY_EXISTS", "STEP_COMMITTED"), ckptd.AlreadyExistsError),
    ],
)
def test_errors_that_are_not_a_missing_daemon_are_never_retried(daemon, answer, cls):
    stub = FakeStub(answer)
    with staged_client(daemon, stub, reconnect_timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(cls):
            c.save(1, {"a": np.zeros(1)}, job="j")
        assert stub.calls == 1 and time.monotonic() - t0 < 5


def test_shutting_down_is_retried(daemon):
    ok = pb.CommitSaveResponse(target=pb.SaveTarget(job="j", step=1, rank=0, attempt="run-1"))
    stopping = rpc_error(UNAVAILABLE, "stopping", "SHUTTING_DOWN")
    stub = FakeStub(stopping, stopping, ok)
    with staged_client(daemon, stub) as c:
        c.save(1, {"a": np.zeros(1)}, job="j").wait(5)
        assert stub.calls == 3
