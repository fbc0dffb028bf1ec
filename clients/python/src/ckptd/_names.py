"""Reversible flattening of nested state dicts into tensor names.

A shard is a flat table of named tensors, and the daemon refuses names with
"/", "..", control bytes or more than 255 bytes. Nested dict keys are joined
with ":" and each key is percent-escaped where it would be ambiguous or
refused, so ``{"model": {"layer.0.weight": w}}`` is stored as
``model:layer.0.weight`` -- readable in ``ckptd restore``'s safetensors file
-- and comes back as the same nesting:

- ``%`` -> ``%25`` and ``:`` -> ``%3A`` (so the separator is unambiguous);
- ``/`` and control bytes -> ``%XX`` (the daemon refuses them);
- a ``.`` followed by another ``.``, and a key that is exactly ``.``,
  -> ``%2E`` (the daemon refuses ``..`` and ``.``).

Only ASCII is ever escaped, so decoding is exact. Dots are left alone
elsewhere because torch state-dict keys are full of them.

A name must also be one that ``ckptd restore`` can write into a safetensors
file: ``__metadata__`` is that format's header key (its writer puts such a
tensor in the header, and its reader then refuses the file), so a top-level
key of that name is refused. The format takes every other string.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ._limits import MAX_NAME_BYTES

SEP = ":"
# Names the safetensors format reserves: its header's metadata entry.
RESERVED = frozenset({"__metadata__"})


# What escape_key escapes: "%", ":", "/", control characters, and a "."
# followed by another (so no segment holds ".."). One regex: names are
# escaped for every tensor of every save.
_ESCAPED = re.compile(r"[%:/\x00-\x1f\x7f]|\.(?=\.)")


def _percent(m: re.Match[str]) -> str:
    return f"%{ord(m.group()):02X}"


def escape_key(key: str) -> str:
    """Escape one dict key so it can be one segment of a tensor name."""
    if key == ".":
        return "%2E"
    return _ESCAPED.sub(_percent, key)


def unescape_key(segment: str) -> str:
    """Invert escape_key.

    A "%" not followed by two hex digits is kept as is, so names written by
    other clients still decode to something sensible.
    """
    if "%" not in segment:
        return segment
    out = []
    i = 0
    while i < len(segment):
        c = segment[i]
        hx = segment[i + 1 : i + 3]
        if c == "%" and len(hx) == 2 and all(h in "0123456789abcdefABCDEF" for h in hx):
            out.append(chr(int(hx, 16)))
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _path_str(path: tuple[str, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "the state"


def flatten(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yield (tensor name, leaf) for every leaf of a nested dict, in order.

    Raises:
        TypeError: state is not a mapping, or a key is not a str.
        ValueError: a key is empty, a nested dict is empty (it could not be
            restored: a shard holds tensors only), a name is too long, or a
            name is reserved by the safetensors format (``__metadata__``).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of arrays or tensors, not {type(state).__name__}")
    yield from _flatten(state, ())


def _flatten(node: Mapping[Any, Any], path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if not isinstance(key, str):
            raise TypeError(
                f"key {key!r} in {_path_str(path)} is a {type(key).__name__}; keys must be str "
                "(ckptd.torch.save_state_dict also takes int keys and non-tensor values)"
            )
        if key == "":
            raise ValueError(f"empty key in {_path_str(path)}")
        sub = (*path, key)
        if isinstance(value, Mapping):
            if not value:
                raise ValueError(
                    f"{_path_str(sub)} is an empty dict, which a checkpoint cannot hold "
                    "(it stores tensors only); drop it or add a tensor"
                )
            yield from _flatten(value, sub)
        else:
            yield _name(sub), value


def _name(path: tuple[str, ...]) -> str:
    name = SEP.join(escape_key(k) for k in path)
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"key {_path_str(path)} is not valid Unicode text: {e}") from None
    if n > MAX_NAME_BYTES:
        raise ValueError(
            f"tensor name for {_path_str(path)} is {n} bytes once flattened "
            f"({name[:60]!r}...), more than the daemon's limit of {MAX_NAME_BYTES}"
        )
    if name in RESERVED:
        raise ValueError(
            f"tensor name {name!r} (key {_path_str(path)}) is reserved by the safetensors "
            "format, which `ckptd restore` writes: its files could not be read back; "
            "rename the key or nest it in a dict"
        )
    return name


def unflatten(items: Iterator[tuple[str, Any]] | list[tuple[str, Any]]) -> dict[str, Any]:
    """Rebuild the nesting that flatten produced.

    Raises:
        ValueError: two names disagree about the nesting (only possible for
            shards written by another client; load them with nested=False).
    """
    root: dict[str, Any] = {}
    for name, value in items:
        path = [unescape_key(s) for s in name.split(SEP)]
        node = root
        for depth, key in enumerate(path[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(_conflict(name, path[: depth + 1]))
            node = child
        if path[-1] in node:
            raise ValueError(_conflict(name, path))
        node[path[-1]] = value
    return root


def _conflict(name: str, path: list[str]) -> str:
    return (
        f"tensor {name!r} does not fit the nesting of the other names at {path!r}; "
        "this shard was not written by the Python client: load it with nested=False"
    )
