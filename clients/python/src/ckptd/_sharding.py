"""The ``ckptd.sharding`` description: which pieces of which global tensors a shard holds.

A rank shard whose tensors are pieces of larger (global) tensors carries one
extra uint8 tensor, ``ckptd.sharding``, holding UTF-8 JSON (the convention
the Go ``ckptd export`` reads to consolidate a step)::

    {"format": "ckptd.sharding", "version": 1,
     "tensors": {"<tensor name in the shard>": {
         "group": "model" | "optimizer" | "extra",
         "fqn": "<key within its group>",
         "global_shape": [...], "offsets": [...]}, ...}}

A piece is named ``<group>:<fqn>`` when its rank holds one piece of that
(group, fqn), ``<group>:<fqn>@<o0>,<o1>,...`` (its offsets) when it holds
several. Names are the stored ones, escaped as the client escapes dict keys
(_names.py), so that the description names exactly what ``ckptd restore``
shows.

This module knows nothing of torch: writers hand it plain ints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _names

TENSOR = "ckptd.sharding"
FORMAT = "ckptd.sharding"
VERSION = 1
GROUPS = ("model", "optimizer", "extra")
# Top-level state-dict keys and the group they name; anything else is "extra".
_TOP_GROUPS = {"model": "model", "optim": "optimizer", "optimizer": "optimizer"}


@dataclass(frozen=True)
class Piece:
    """One piece of a global tensor held by a rank."""

    group: str
    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, not {self.group!r}")
        if len(self.offsets) != len(self.global_shape):
            raise ValueError(
                f"{self.group}:{self.fqn}: offsets {list(self.offsets)} and global shape "
                f"{list(self.global_shape)} differ in length"
            )


def group_of(path: Sequence[Any]) -> tuple[str, str]:
    """The (group, fqn) of a state-dict entry, given its path of keys.

    The top-level key "model" names group "model", "optim" and "optimizer"
    group "optimizer", each with the rest of the path joined by "." as fqn;
    anything else is group "extra" with the whole path as fqn.
    """
    parts = [str(p) for p in path]
    if not parts:
        raise ValueError("an empty path names no state-dict entry")
    group = _TOP_GROUPS.get(parts[0])
    if group is None or len(parts) == 1:
        return "extra", ".".join(parts)
    return group, ".".join(parts[1:])


def key_path(group: str, fqn: str, offsets: Sequence[int] | None) -> tuple[str, str]:
    """The two dict keys that store a piece: {group: {key: tensor}}.

    offsets is None when the rank holds one piece of (group, fqn); else the
    key carries them, as ``fqn@o0,o1``.
    """
    key = fqn if offsets is None else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"
    return group, key


def stored_name(path: Sequence[str]) -> str:
    """The tensor name the client stores for a path of dict keys."""
    return _names.SEP.join(_names.escape_key(k) for k in path)


def encode(pieces: Mapping[str, Piece]) -> np.ndarray:
    """The ``ckptd.sharding`` tensor describing pieces (stored name -> Piece)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "tensors": {
            name: {
                "group": p.group,
                "fqn": p.fqn,
                "global_shape": [int(d) for d in p.global_shape],
                "offsets": [int(o) for o in p.offsets],
            }
            for name, p in pieces.items()
        },
    }
    blob = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    out: np.ndarray = np.frombuffer(blob, dtype=np.uint8).copy()
    return out


def decode(blob: Any) -> dict[str, Piece]:
    """Invert encode: stored name -> Piece. blob: a uint8 array or tensor.

    Raises:
        ValueError: not a ckptd.sharding description this client knows.
    """
    raw = blob.numpy().tobytes() if hasattr(blob, "numpy") else np.asarray(blob).tobytes()
    doc = json.loads(raw)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(
            f"not a {FORMAT} v{VERSION} description: format {doc.get('format')!r} "
            f"version {doc.get('version')!r}"
        )
    return {
        name: Piece(
            group=d["group"],
            fqn=d["fqn"],
            global_shape=tuple(d["global_shape"]),
            offsets=tuple(d["offsets"]),
        )
        for name, d in doc["tensors"].items()
    }


def repeated(keys: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (group, fqn) pairs that occur more than once in keys."""
    seen: set[tuple[str, str]] = set()
    twice: set[tuple[str, str]] = set()
    for k in keys:
        (twice if k in seen else seen).add(k)
    return twice
