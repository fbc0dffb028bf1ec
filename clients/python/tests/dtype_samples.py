"""torch's dtypes, enumerated from torch itself, and tensors of each with random bits.

For test_dtypes.py and the DCP workers: a dtype a later torch adds shows up
in STORED (or, quantized, in neither list) without anyone listing it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ckptd import _tensors


def torch_dtypes() -> list[torch.dtype]:
    """Every dtype the torch module names."""
    found = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted(found, key=str)


def holdable(d: torch.dtype) -> bool:
    """Whether a plain (not quantized) tensor of d can be made."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "support is experimental", "deprecated"
        try:
            return not torch.empty(1, dtype=d).is_quantized
        except (RuntimeError, TypeError):
            return False


STORED = [d for d in torch_dtypes() if holdable(d)]
NAME = {d: str(d).removeprefix("torch.") for d in torch_dtypes()}


def sample(d: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of d with random bits: 2-d, strided (transposed), 0-d and empty."""
    size = torch.empty(0, dtype=d).element_size()
    g = torch.Generator().manual_seed(seed)
    top = 2 if d == torch.bool else 256  # a bool byte is 0 or 1
    raw = torch.randint(0, top, (3, 5 * size), generator=g, dtype=torch.uint8)
    grid = raw.view(d)  # (3, 5)
    scalar = torch.randint(0, top, (size,), generator=g, dtype=torch.uint8).view(d)[0]
    return {"grid": grid, "t": grid.t(), "scalar": scalar, "empty": torch.empty(0, 4, dtype=d)}


def same_bits(a: Any, b: torch.Tensor) -> bool:
    """Whether a is a tensor of b's dtype and shape holding b's bytes."""
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(raw_bytes(a) == raw_bytes(b))


def raw_bytes(t: torch.Tensor) -> bytes:
    flat = _tensors.bits(torch, t).reshape(-1)  # reshape copies a strided one, bit for bit
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def dcp_plans(d: torch.dtype) -> bool:
    """Whether DCP's own planner can plan a tensor of d (it needs its element size)."""
    try:
        torch._utils._element_size(d)
    except (TypeError, RuntimeError):
        return False
    return True


DCP_DTYPES = [d for d in STORED if dcp_plans(d)]


def dcp_samples(seed: int) -> dict[str, torch.Tensor]:
    """Flat tensors of every dtype DCP plans, for a state dict's "extra"."""
    return {
        f"{NAME[d]}.{k}": t
        for i, d in enumerate(DCP_DTYPES)
        for k, t in sample(d, seed * 1000 + i).items()
    }
