"""The protocol's limits, defined once on the Python side, and checks against them.

Each value is a copy of the daemon's, so a request the daemon would refuse
for its size fails here first, with a message that says what to do. The
comment by each names the Go identifier (and the file, as of this writing)
that it copies: change both together.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Trainer metadata of one save: checkpoint.MaxMetadata (checkpoint/save.go).
MAX_METADATA = 8 << 20

# The largest message the daemon receives: ckptdv1.MaxMessageBytes
# (proto/ckptd/v1/limits.go). The client's send limit.
MAX_MESSAGE = 16 << 20

# A tensor or job name, in bytes: checkpoint.MaxNameLen (checkpoint/names.go).
MAX_NAME_BYTES = 255

# Bytes per data message of a streamed restore: ckptdv1.StreamChunkBytes
# (proto/ckptd/v1/limits.go). Streamed saves send pieces of the same size.
STREAM_CHUNK = 1 << 20

# The ranges [low, high) of the protocol's integer fields
# (proto/ckptd/v1/ckptd.proto): what could not even be sent is refused here,
# every other range rule is the daemon's.
INT32 = (-(1 << 31), 1 << 31)  # rank, world_size, batch_size, shuffle_window, shuffle_block
INT64 = (-(1 << 63), 1 << 63)  # step, epoch, start
UINT64 = (0, 1 << 64)  # seed


def as_int(name: str, v: Any) -> int:
    """The int value of v; a bool or a non-integer is a TypeError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    return int(v)


def within(v: int, bounds: tuple[int, int]) -> bool:
    """Whether v lies in a protocol field's range [low, high)."""
    return bounds[0] <= v < bounds[1]
