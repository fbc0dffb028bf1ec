"""Which leaves of a saved state were torch tensors, so that a load gives them back so.

A shard holds tensors only; whether one came from torch or numpy is not
part of it. So a save with torch tensors records it in empty (0-byte)
uint8 tensors under ``ckptd.as``: ``ckptd.as:torch`` (or
``ckptd.as:numpy``) names the kind most leaves had, and
``ckptd.as:except:<escaped stored name>`` each leaf of the other kind. A
save of numpy arrays alone records nothing, so its shard is what it was
before, and a shard with no record loads as numpy. Being empty, the
records cost no bytes, ``ckptd restore`` leaves them out of its
safetensors files, and ``ckptd export`` never exports them (no ``model:``
name); loads strip them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _limits, _names
from ._errors import InvalidArgumentError

KEY = "ckptd.as"
_PREFIX = KEY + _names.SEP
_EXCEPT = _PREFIX + "except" + _names.SEP


def mark(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """state, with the record of its torch leaves when it has any."""
    torch: Any = sys.modules.get("torch")  # a torch tensor exists only once torch is imported
    given: Any = state
    if torch is None or not isinstance(given, Mapping):
        return state  # nothing of torch's; or not a dict, which save() refuses
    if KEY in state:
        raise InvalidArgumentError(
            f"the key {KEY!r} is reserved: ckptd records there which tensors were torch's"
        )
    try:
        kinds = [(n, isinstance(v, torch.Tensor)) for n, v in _names.flatten(state)]
    except (TypeError, ValueError):
        return state  # a state save() refuses, with its own error
    torch_leaves = sum(t for _, t in kinds)
    if torch_leaves == 0:
        return state
    default = torch_leaves * 2 >= len(kinds)
    others = [n for n, t in kinds if t != default]
    if any(len((_EXCEPT + _names.escape_key(n)).encode()) > _limits.MAX_NAME_BYTES for n in others):
        return state  # a name too long to record: loads give numpy, as they did
    empty = np.empty(0, np.uint8)
    record: dict[str, Any] = {"torch" if default else "numpy": empty}
    if others:
        record["except"] = {n: empty for n in others}
    return {**state, KEY: record}


def split(names: Sequence[str]) -> tuple[bool | None, set[str]]:
    """(True: torch by default, False: numpy, None: no record) and the exceptions.

    names are a restored shard's stored tensor names.
    """
    default: bool | None = None
    others: set[str] = set()
    for n in names:
        if n == _PREFIX + "torch":
            default = True
        elif n == _PREFIX + "numpy":
            default = False
        elif n.startswith(_EXCEPT):
            others.add(_names.unescape_key(n[len(_EXCEPT) :]))
    return default, others


def is_record(name: str) -> bool:
    """Whether a stored name is one of the records (stripped from loads)."""
    return name.startswith(_PREFIX)
