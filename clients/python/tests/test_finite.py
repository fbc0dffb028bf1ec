"""A run that diverged: load("latest", finite=True) restarts before it did."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ckptd


def test_latest_finite_passes_over_nan(daemon, caplog: pytest.LogCaptureFixture) -> None:
    c = ckptd.Client(daemon.socket)
    good = {"w": np.arange(1000, dtype=np.float32), "step": np.array(1)}
    c.save(1, good, rank=0, world_size=1).wait()
    for step, bad in ((2, np.float32("nan")), (3, np.float32("-inf"))):
        w = np.arange(1000, dtype=np.float32)
        w[7] = bad
        c.save(step, {"w": w, "step": np.array(step)}, rank=0, world_size=1).wait()

    newest = c.load("latest", rank=0)
    assert newest.step == 3 and newest.skipped_nonfinite == []
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        state = c.load("latest", rank=0, finite=True)
    assert state.step == 1 and state.skipped_nonfinite == [3, 2]
    np.testing.assert_array_equal(state["w"], good["w"])
    assert "passed over steps [3, 2]" in caplog.text
    with pytest.raises(ValueError, match="latest"):
        c.load(1, rank=0, finite=True)
