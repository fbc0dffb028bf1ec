"""The client maps the pages of the arena it uses, not the whole arena, on a real daemon."""

from __future__ import annotations

import numpy as np

import ckptd
from ckptd import _arena

MiB = 1 << 20


def mapped_kib(path: str) -> int:
    """Resident KiB of this process's mapping of the file at path (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = head[-1] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_a_first_save_and_load_map_only_their_region(make_daemon):
    d = make_daemon(staging="1GiB")
    state = {"w": np.arange(2 * MiB, dtype=np.float32)}  # 8 MiB
    with ckptd.Client(d.socket) as c:
        c.save(1, state, job="map").wait(60)
        np.testing.assert_array_equal(c.load(1, job="map")["w"], state["w"])
        arena = c._conn.arena
        assert arena is not None
        kib = mapped_kib(arena.path)
        if arena._mapped is None:  # a kernel before 5.14: mapped whole, as the test below
            assert kib >= 1000 * 1024
        else:
            assert 8 * 1024 <= kib <= 64 * 1024, f"{kib} KiB of a 1 GiB arena mapped"


def test_without_populate_the_whole_arena_is_mapped_up_front(make_daemon, monkeypatch):
    """A kernel that refuses the advice (before 5.14) gets MAP_POPULATE, as before."""
    monkeypatch.setattr(_arena, "_MADV_POPULATE_READ", 9999)  # no such advice: EINVAL
    d = make_daemon(staging="64MiB")
    state = {"w": np.arange(MiB, dtype=np.float64)}
    with ckptd.Client(d.socket) as c:
        c.save(1, state, job="map").wait(60)
        arena = c._conn.arena
        assert arena is not None and arena._mapped is None
        np.testing.assert_array_equal(c.load(1, job="map")["w"], state["w"])
        assert mapped_kib(arena.path) >= 60 * 1024
