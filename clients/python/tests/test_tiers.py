"""ckptd serve --persist-every: the steps it does not persist are kept in memory."""

from __future__ import annotations

import socket
import time
import warnings

import numpy as np
import pytest

import ckptd


def test_steps_kept_in_memory(make_daemon):
    d = make_daemon("--hot-bytes", "64MiB", "--persist-every", "2")
    with d.client() as c:
        states = {step: {"w": np.full(100_000, step, dtype=np.float32)} for step in (1, 2, 3)}
        handles = {step: c.save(step, s, rank=0, world_size=1) for step, s in states.items()}
        for h in handles.values():
            h.wait(30)
        # No peers: a step not persisted ends in this node's memory.
        assert handles[1].status is ckptd.SaveStatus.HOT
        assert handles[2].status is ckptd.SaveStatus.COMMITTED
        assert handles[3].status is ckptd.SaveStatus.HOT
        assert [s.step for s in c.steps()] == [2]  # the committed (persisted) steps

        got = c.load("latest", rank=0)
        assert (got.step, got.tier, got.skipped_step) == (3, "hot", 0)
        assert np.array_equal(got["w"], states[3]["w"])
        assert _load_hot(c, 2).tier == "hot"  # kept a moment after its commit

    # A daemon that lost its memory restores the last persisted step.
    d.stop()
    d.start()
    with d.client() as c:
        got = c.load("latest", rank=0)
        assert (got.step, got.tier) == (2, "storage")
        assert np.array_equal(got["w"], states[2]["w"])


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_not_replicated_warns(make_daemon):
    """A save kept in memory that reached no peer warns; it still stands (HOT)."""
    me, dead = _free_addr(), _free_addr()  # nothing listens at dead: its peer is down
    d = make_daemon(
        *("--hot-bytes", "64MiB", "--persist-every", "2", "--peers", f"{me},{dead}"),
        *("--peer-listen", me, "--peer-insecure"),
    )
    with d.client() as c:
        h = c.save(1, {"w": np.full(1000, 1, dtype=np.float32)}, rank=0, world_size=1)
        with pytest.warns(ckptd.NotReplicatedWarning, match="memory only.*peer"):
            h.wait(120)
        assert h.status is ckptd.SaveStatus.HOT
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            h.wait(1)  # warned once
            c.save(2, {"w": np.full(1000, 2, dtype=np.float32)}, rank=0, world_size=1).wait(120)
        assert c.load("latest", rank=0).step == 2


def _load_hot(c: ckptd.Client, step: int, **kw) -> ckptd.LoadedState:
    """Load step once the drain kept its hot copy (a moment after the commit)."""
    for _ in range(300):
        got = c.load(step, rank=0, **kw)
        if got.tier == "hot":
            return got
        time.sleep(0.1)
    raise AssertionError(f"step {step} never restored from the hot tier")


def test_loads_from_the_hot_tier_in_place(make_daemon):
    """A restore from the hot tier reads the daemon's copy where it lies, read-only.

    Whole shards and some of their tensors load bit for bit from the hot
    tier's file, which the client maps read-only; a restarted daemon's
    new file is mapped anew.
    """
    d = make_daemon("--hot-bytes", "64MiB")
    state = {
        "a": np.arange(100_000, dtype=np.float32),
        "b": np.arange(10, dtype=np.int64),
        "c": np.ones((3, 4), dtype=np.float16),
        "empty": np.zeros(0, dtype=np.float32),
    }
    with d.client() as c:
        c.save(1, state, rank=0, world_size=1).wait(30)
        got = _load_hot(c, 1)
        assert all(np.array_equal(got[k], v) for k, v in state.items())
        part = _load_hot(c, 1, tensors=["c", "a"])
        assert set(part) == {"c", "a"}
        assert np.array_equal(part["a"], state["a"]) and np.array_equal(part["c"], state["c"])
        hot = c._conn._hot
        assert hot is not None and not hot.writable
        with pytest.raises(ValueError, match="read-only"):
            hot.mem[0] = 1  # the client cannot change the daemon's copy

        d.stop()
        d.start()
        with d.client() as other:  # c's first call after the restart is a restore in place
            other.save(2, state, rank=0, world_size=1).wait(30)
            _load_hot(other, 2)
        got = c.load(2, rank=0)
        assert got.tier == "hot"
        assert all(np.array_equal(got[k], v) for k, v in state.items())
        assert c._conn._hot is not None and c._conn._hot is not hot


def test_a_hot_tier_that_cannot_be_mapped_is_copied(make_daemon, monkeypatch):
    """A client that cannot map the hot tier's file loads copies, with one warning."""
    from ckptd import _transport

    real = _transport.Arena

    def no_read_only(path, size, owner, writable=True):
        if not writable:
            raise PermissionError(13, "Permission denied", path)
        return real(path, size, owner, writable)

    monkeypatch.setattr(_transport, "Arena", no_read_only)
    d = make_daemon("--hot-bytes", "64MiB")
    state = {"w": np.arange(50_000, dtype=np.float32)}
    with d.client() as c:
        c.save(1, state, rank=0, world_size=1).wait(30)
        with pytest.warns(RuntimeWarning, match="copied into the arena"):
            got = _load_hot(c, 1)
        assert np.array_equal(got["w"], state["w"])
        assert not c._conn.in_place
        assert np.array_equal(_load_hot(c, 1)["w"], state["w"])
