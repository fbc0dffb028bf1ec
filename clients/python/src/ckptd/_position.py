"""Dataset positions that survive a change of world size, on the client side.

The daemon encodes which samples of an epoch were delivered (prefetch/
delivered.go: ``"ckd1"``, then per shard its name, its sample count and a
bitmap over its samples). A client unions them -- the positions of every
rank, or of every batch a DataLoader consumed -- as the daemon would, so
that a checkpoint holds one position rather than a growing list. In a
state meant for JSON a position is base64 text (``text``/``blob``).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

from ._errors import InvalidArgumentError

MAGIC = b"ckd1"


class Position:
    """A set of delivered samples: per shard, its sample count and a bitmap."""

    def __init__(self) -> None:
        self.shards: dict[bytes, tuple[int, bytearray]] = {}

    def add(self, blob: bytes) -> None:
        """Union an encoded position into this one."""
        for name, total, bits in _decode(blob):
            old = self.shards.get(name)
            if old is None:
                self.shards[name] = (total, bytearray(bits))
                continue
            have = old[1]
            if len(bits) > len(have):
                have.extend(bytes(len(bits) - len(have)))
            for i, b in enumerate(bits):
                have[i] |= b
            self.shards[name] = (max(old[0], total), have)

    def encode(self) -> bytes:
        """The daemon's encoding, shards in name order."""
        out = bytearray(MAGIC)
        out += _uvarint(len(self.shards))
        for name in sorted(self.shards):
            total, bits = self.shards[name]
            out += _uvarint(len(name)) + name + _uvarint(total) + _uvarint(len(bits)) + bits
        return bytes(out)

    def count(self) -> int:
        """Samples in the set."""
        return sum(bin(b).count("1") for _, bits in self.shards.values() for b in bits)

    def __bool__(self) -> bool:
        return bool(self.shards)


def union(blobs: Iterable[bytes]) -> bytes:
    """One encoded position holding every sample of blobs."""
    p = Position()
    for b in blobs:
        p.add(b)
    return p.encode()


def text(blob: bytes) -> str:
    """A position as base64 text, for JSON."""
    return base64.b64encode(blob).decode("ascii")


def blob(value: object, what: str = "delivered") -> bytes:
    """A position given as bytes or as text() made of them."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(
                f"{what}: {value[:40]!r} is not base64 (a position as Dataset.state() gives it)"
            ) from None
    raise TypeError(f"{what} holds positions as bytes or base64 str, not {type(value).__name__}")


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _decode(b: bytes) -> Iterable[tuple[bytes, int, bytes]]:
    if not b.startswith(MAGIC):
        raise InvalidArgumentError("not a dataset position (no ckd1 header)")
    i = len(MAGIC)

    def uvarint() -> int:
        nonlocal i
        n = shift = 0
        while True:
            if i >= len(b) or shift > 63:
                raise InvalidArgumentError("a dataset position ends early")
            c = b[i]
            i += 1
            n |= (c & 0x7F) << shift
            if c < 0x80:
                return n
            shift += 7

    def take(n: int) -> bytes:
        nonlocal i
        if n > len(b) - i:
            raise InvalidArgumentError("a dataset position ends early")
        i += n
        return b[i - n : i]

    out = []
    for _ in range(uvarint()):
        name = take(uvarint())
        total = uvarint()
        out.append((name, total, take(uvarint())))
    if i != len(b):
        raise InvalidArgumentError("a dataset position has bytes after its last shard")
    return out
