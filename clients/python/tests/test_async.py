"""Saves return before they are durable; handles follow them to the commit."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np
import pytest

import ckptd


def test_save_while_an_earlier_save_still_drains(make_daemon, job):
    # The drain delay leaves room for a slow machine: both saves and both
    # status checks must happen while the first drain is still held.
    d = make_daemon("--debug-drain-delay", "4s", "--drains", "1")
    a = np.arange(1 << 20, dtype=np.float32)
    with d.client() as c:
        t0 = time.monotonic()
        h1 = c.save(1, {"w": a}, job=job)
        h2 = c.save(2, {"w": a * 2}, job=job)  # the first is still in the arena
        assert time.monotonic() - t0 < 3.0  # neither save waited for a drain
        assert not h1.done() and not h2.done()
        assert h1.status == ckptd.SaveStatus.DRAINING  # held by the delayed drain worker
        assert h2.status == ckptd.SaveStatus.STAGED  # queued behind it (--drains 1)
        a[:] = -1  # the caller owns its tensors again as soon as save returns
        h1.wait(30)
        h2.wait(30)
        assert h1.done() and h2.status == ckptd.SaveStatus.COMMITTED
        assert np.array_equal(c.load(1, job=job)["w"], np.arange(1 << 20, dtype=np.float32))
        assert np.array_equal(c.load(2, job=job)["w"], np.arange(1 << 20, dtype=np.float32) * 2)


def test_wait_timeout_leaves_the_save_going(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    with d.client() as c:
        h = c.save(1, {"w": np.zeros(10)}, job=job)
        with pytest.raises(ckptd.TimeoutError, match="goes on"):
            h.wait(timeout=0.05)
        with pytest.raises(TimeoutError):  # the builtin catches it too
            h.wait(timeout=0)
        h.wait(timeout=30)
        h.wait()  # waiting again on a finished save returns at once
        assert repr(h) == (
            f"SaveHandle(job={job!r}, step=1, rank=0, attempt={c.attempt!r}, status=committed)"
        )


def test_done_polls_without_blocking(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "500ms")
    with d.client() as c:
        h = c.save(1, {"w": np.zeros(10)}, job=job)
        polls = 0
        deadline = time.monotonic() + 30
        while not h.done():
            assert time.monotonic() < deadline
            polls += 1
            time.sleep(0.01)
        assert polls > 5
        assert h.status == ckptd.SaveStatus.COMMITTED


def test_daemon_restart_remaps_the_new_arena(make_daemon, job):
    d = make_daemon()
    with d.client() as c:
        c.save(1, {"w": np.full(1000, 1.0)}, job=job).wait(30)
        d.stop()  # clean shutdown: the arena file is deleted
        d.start()  # a new arena file at the same path
        # The client's old mapping points at the deleted file; writing there
        # would lose the save silently. It must notice and remap.
        c.save(2, {"w": np.full(1000, 2.0)}, job=job).wait(30)
        assert c.load(2, job=job)["w"][0] == 2.0
        assert c.load(1, job=job)["w"][0] == 1.0


def test_handle_survives_a_daemon_crash(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    with d.client() as c:
        h = c.save(1, {"w": np.full(4096, 7, np.int32)}, job=job)
        d.kill9()  # accepted, journaled in shared memory, not durable
        d.start()  # drains the journal
        h.wait(60)
        assert c.load(1, job=job)["w"][0] == 7


def test_handles_of_a_closed_client(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    c = d.client()
    h = c.save(1, {"w": np.zeros(10)}, job=job)
    c.close()
    assert not h.done()  # unknown, not failed: the daemon still drains it
    assert h.status == ckptd.SaveStatus.STAGED
    with pytest.raises(ckptd.ClientClosedError):
        h.wait(5)
    # Another client (a restarted trainer of the same run) can follow it.
    with d.client(attempt=c.attempt) as c2:
        h2 = c2.handle(1, job=job)
        h2.wait(30)
        assert h2.status == ckptd.SaveStatus.COMMITTED
        with pytest.raises(ckptd.NotFoundError, match="no save"):
            c2.handle(2, job=job).wait(30)


def test_a_handle_is_a_future_that_settles_by_itself(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    with d.client() as c:
        h = c.save(1, {"w": np.zeros(10)}, job=job)
        assert isinstance(h, concurrent.futures.Future)
        assert h.running() and not h.done() and not h.cancelled()
        assert h.cancel() is False  # a staged save cannot be taken back
        assert not h.cancelled() and h.running()
        with pytest.raises(concurrent.futures.TimeoutError):
            h.result(timeout=0.05)
        with pytest.raises(concurrent.futures.TimeoutError):
            h.exception(timeout=0.05)
        calls = []
        ran = threading.Event()

        def record(f):
            calls.append((f, threading.current_thread()))
            ran.set()

        h.add_done_callback(record)
        done, _ = concurrent.futures.wait([h], timeout=30)  # nobody polls the handle
        assert done == {h}
        assert ran.wait(10)
        assert h.result() is None and h.exception() is None
        assert not h.running() and h.status == ckptd.SaveStatus.COMMITTED
        late = []
        ran.clear()
        h.add_done_callback(lambda f: (late.append(threading.current_thread()), ran.set()))
        assert ran.wait(10)  # settled already: called all the same
        time.sleep(0.2)
    assert [f for f, _ in calls] == [h]  # once
    for t in (calls[0][1], late[0]):  # on a thread of the handle's own
        assert t is not threading.main_thread() and t.name.startswith("ckptd-done-")


def test_a_failed_handle_holds_its_error_and_logs_callback_errors(daemon, job, caplog):
    with daemon.client() as c:
        h = c.handle(1, job=job)  # no such save
        got = []

        def broken(f):
            raise RuntimeError("callback bug")

        h.add_done_callback(broken)
        h.add_done_callback(got.append)  # runs even though the one before raised
        assert list(concurrent.futures.as_completed([h], timeout=30)) == [h]
        assert isinstance(h.exception(), ckptd.NotFoundError)
        with pytest.raises(ckptd.NotFoundError):
            h.result()
        with pytest.raises(ckptd.NotFoundError):
            h.wait()
        assert h.status == ckptd.SaveStatus.FAILED
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [h]
    assert any("callback bug" in r.exc_text for r in caplog.records if r.exc_text)
    assert all(r.levelno == logging.ERROR for r in caplog.records if r.exc_text)


def test_a_handle_settles_after_a_daemon_restart_without_polling(make_daemon, job):
    d = make_daemon("--debug-drain-delay", "1s")
    with d.client() as c:
        h = c.save(1, {"w": np.full(64, 3, np.int32)}, job=job)
        settled = threading.Event()
        h.add_done_callback(lambda f: settled.set())
        d.kill9()  # accepted and journaled: the next daemon drains it
        time.sleep(0.5)
        d.start()
        done, _ = concurrent.futures.wait([h], timeout=60)
        assert done == {h} and settled.wait(10)
        assert h.exception() is None
