"""Hashes of what a save copied, for a daemon whose arena other users share.

A daemon started with ``--socket-group`` lets the group's members map its
arena, so one of them could rewrite another's staged bytes between the
copy and the drain. Such a daemon answers BeginSave with a CopyCheck: the
ends of the chunks of the save's data space (the tensors' bytes back to
back, in region order) and a key of that lease's alone. The client takes
each chunk's MAC (BLAKE3 keyed with it) from its own memory, not from the
shared region, and sends the MACs with CommitSave; the daemon stores the
save only if the bytes it drains have the same MACs. A member, who cannot
read the key, cannot make other bytes pass: a rewrite fails the save.

A tensor on a GPU is copied to host memory of the client's own first (not
by DMA into the arena, as without the check), then copied as hashed.

Restores go the other way: such a daemon restores whole chunks and says
in the RestoreHeader their MACs (under a key of that restore's), taken
from its own copy; the client copies the region out of the arena and
checks its copy (check_restored) before it uses it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import blake3
import numpy as np

from . import _copy, _tensors
from ._errors import CkptdError, DataLossError

PIECE = 256 << 10  # copied then hashed while it is in the core's cache


def copy_and_hash(
    leaves: Sequence[_tensors.Leaf],
    ends: Sequence[int],
    key: bytes,
    region: np.ndarray,
    copy_rest: Callable[[list[_tensors.Leaf]], None],
) -> list[int]:
    """Copy leaves into region and return the MAC under key of each chunk that ends cuts.

    A host leaf held contiguous, little-endian, is copied and hashed a
    piece at a time, from its own memory while the piece is in cache: one
    pass over it; so is a device's, from a host copy of its own. The others
    (strided or big-endian views) go through copy_rest first, then are
    hashed from a contiguous copy of their own.
    """
    starts, views, dsts, rest = _sources(leaves, region)
    copy_rest(rest)
    total = sum(v.size for v in views)
    covered = ends[-1] if ends else 0
    if covered != total:
        raise CkptdError(f"the daemon's copy check covers {covered} bytes, the save {total}")

    return _hash_chunks(starts, views, dsts, ends, key)


def mac(key: bytes) -> Any:
    """The check's MAC (CopyCheck in the proto): BLAKE3 keyed with the lease's key."""
    if len(key) != 32:
        raise CkptdError(f"the daemon's copy check has a key of {len(key)} bytes, not 32")
    return blake3.blake3(key=key)


def _sum(h: Any) -> int:
    """A MAC's value: the first 8 bytes of its output, little-endian."""
    return int.from_bytes(h.digest(8), "little")


def _hash_chunks(
    starts: list[int],
    views: list[np.ndarray],
    dsts: list[np.ndarray | None],
    ends: Sequence[int],
    key: bytes,
) -> list[int]:
    """The MAC of each chunk of the data space (views at starts), copying to dsts on the way."""
    mac(key)  # a bad key fails here, not in a thread

    def one(i: int) -> int:
        a, b = (ends[i - 1] if i else 0), ends[i]
        h = mac(key)
        j = bisect.bisect_right(starts, a) - 1
        while a < b:
            lo, hi = a - starts[j], min(b - starts[j], views[j].size)
            src, dst = views[j], dsts[j]
            for k in range(lo, hi, PIECE):
                piece = src[k : min(k + PIECE, hi)]
                if dst is not None:
                    np.copyto(dst[k : k + piece.size], piece)
                h.update(piece.data)
            a, j = starts[j] + hi, j + 1
        return _sum(h)

    return _copy.map_threads(one, len(ends), sum(v.size for v in views))


def check_copied(
    leaves: Sequence[_tensors.Leaf],
    copies: Sequence[_tensors.Leaf],
    ends: Sequence[int],
    key: bytes,
    want: Sequence[int],
    what: str,
) -> None:
    """Raise CkptdError unless copies (of leaves, out of their region) have the MACs want.

    For a save made again from its staged bytes: they are used only as they
    were when the client hashed them.
    """
    order = sorted(range(len(leaves)), key=lambda i: leaves[i].offset)
    starts: list[int] = []
    views: list[np.ndarray] = []
    pos = 0
    for i in order:
        if leaves[i].nbytes:
            starts.append(pos)
            views.append(np.asarray(copies[i].value).reshape(-1).view(np.uint8))
            pos += leaves[i].nbytes
    fits = (ends[-1] if ends else 0) == pos and len(ends) == len(want)
    if not fits or _hash_chunks(starts, views, [None] * len(views), ends, key) != list(want):
        raise CkptdError(
            f"{what}: the staged copy changed in the daemon's shared arena since it was "
            "copied (a member of its --socket-group?); it is not saved again"
        )


def _sources(
    leaves: Sequence[_tensors.Leaf], region: np.ndarray
) -> tuple[list[int], list[np.ndarray], list[np.ndarray | None], list[_tensors.Leaf]]:
    """Each non-empty leaf's data-space offset, bytes as stored, and place to copy them as hashed.

    Also the leaves to copy apart first (place None): strided or big-endian.
    """
    starts: list[int] = []
    views: list[np.ndarray] = []
    dsts: list[np.ndarray | None] = []
    rest: list[_tensors.Leaf] = []
    pos = 0
    for leaf in sorted(leaves, key=lambda x: x.offset):
        if leaf.nbytes == 0:
            continue
        place = region[leaf.offset : leaf.offset + leaf.nbytes]
        dst: np.ndarray | None = None
        if _tensors.on_device(leaf):
            # Through memory of our own, never hashed from the arena: a
            # synchronous copy from the device, then copied as hashed.
            v, dst = np.empty(leaf.nbytes, np.uint8), place
            _tensors.copy_in(leaf, v, lambda: False)
        else:
            typed, src = _tensors.host_pair(leaf, place)
            if src.flags.c_contiguous and src.dtype == typed.dtype:
                v, dst = src.reshape(-1).view(np.uint8), place
            else:  # hashed from a contiguous little-endian copy of its own
                v = np.ascontiguousarray(src, dtype=typed.dtype).reshape(-1).view(np.uint8)
                rest.append(leaf)
        starts.append(pos)
        views.append(v)
        dsts.append(dst)
        pos += leaf.nbytes
    return starts, views, dsts, rest


def check_restored(check: Any, data: np.ndarray, what: str) -> None:
    """Raise DataLossError unless data, a private copy of a restore, hashes as check says.

    check is the RestoreHeader's CopyCheck: whole chunks, their ends in
    data and their hashes, from the manifest.
    """
    ends, want = list(check.chunk_ends), list(check.chunk_hashes)
    if len(ends) != len(want) or (ends[-1] if ends else 0) != data.size:
        raise DataLossError(
            f"{what}: the daemon's check covers {ends[-1] if ends else 0} bytes in "
            f"{len(ends)} chunks with {len(want)} hashes, the restore {data.size} bytes",
            reason="CORRUPT",
        )

    key = bytes(check.key)
    mac(key)

    def one(i: int) -> int:
        h = mac(key)
        h.update(data[(ends[i - 1] if i else 0) : ends[i]].data)
        return _sum(h)

    got = _copy.map_threads(one, len(ends), data.size)
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if bad:
        raise DataLossError(
            f"{what}: {len(bad)} of {len(ends)} chunks of the restored bytes changed in the "
            "daemon's shared arena before this client copied them out (a member of its "
            "--socket-group?); nothing was loaded",
            reason="CORRUPT",
        )
