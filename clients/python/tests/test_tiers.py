"""ckptd serve --persist-every: the steps it does not persist are kept in memory."""

from __future__ import annotations

import numpy as np

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
        assert c.load(2, rank=0).tier == "hot"

    # A daemon that lost its memory restores the last persisted step.
    d.stop()
    d.start()
    with d.client() as c:
        got = c.load("latest", rank=0)
        assert (got.step, got.tier) == (2, "storage")
        assert np.array_equal(got["w"], states[2]["w"])
