"""One knob for a slow machine, as the Go tests' internal/testtime.

Every wait of a test is a deadline on an event, and every such deadline is
scaled by CKPTD_TEST_SLOWDOWN (a factor, 1 when unset). The deadlines hold
at 1 on a machine whose every core another job keeps busy (make test-busy).
"""

from __future__ import annotations

import os


def factor() -> float:
    """CKPTD_TEST_SLOWDOWN, at least 1."""
    try:
        return max(1.0, float(os.environ.get("CKPTD_TEST_SLOWDOWN", "1")))
    except ValueError:
        return 1.0


def scaled(seconds: float) -> float:
    """A deadline of seconds, stretched by the slowdown factor."""
    return seconds * factor()
