"""Tensor leaves: dtypes, validation, and copies into and out of byte buffers.

Everything here works on flat ``uint8`` numpy buffers (a region of the
arena, or a scratch buffer for the streaming fallback), so the same code
serves both transports. torch is never imported here unless the caller
already did (a torch tensor can only exist once torch is imported), or a
restored dtype needs it (bfloat16, float8, ...), because importing torch costs
seconds.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


@dataclass(frozen=True)
class DType:
    """One element type as the daemon spells it (checkpoint/dtype: safetensors' names).

    ``raw`` is the little-endian numpy dtype that holds the bits: the real
    numpy type where one exists, an unsigned integer of the same width for
    the types numpy lacks (bfloat16, float8, complex32, torch's bit and
    sub-byte containers).
    """

    name: str
    raw: np.dtype[Any]
    torch_name: str
    numpy_native: bool = True

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.raw.itemsize


def _opaque(name: str, raw: str, torch_name: str) -> DType:
    return DType(name, np.dtype(raw), torch_name, numpy_native=False)


DTYPES: tuple[DType, ...] = (
    DType("BOOL", np.dtype("?"), "bool"),
    DType("U8", np.dtype("u1"), "uint8"),
    DType("I8", np.dtype("i1"), "int8"),
    _opaque("F8_E4M3", "u1", "float8_e4m3fn"),
    _opaque("F8_E5M2", "u1", "float8_e5m2"),
    DType("U16", np.dtype("<u2"), "uint16"),
    DType("I16", np.dtype("<i2"), "int16"),
    DType("F16", np.dtype("<f2"), "float16"),
    _opaque("BF16", "<u2", "bfloat16"),
    DType("U32", np.dtype("<u4"), "uint32"),
    DType("I32", np.dtype("<i4"), "int32"),
    DType("F32", np.dtype("<f4"), "float32"),
    DType("U64", np.dtype("<u8"), "uint64"),
    DType("I64", np.dtype("<i8"), "int64"),
    DType("F64", np.dtype("<f8"), "float64"),
    DType("C64", np.dtype("<c8"), "complex64"),
    # The rest of torch's dtypes; a daemon older than these refuses them.
    _opaque("F8_E4M3FNUZ", "u1", "float8_e4m3fnuz"),
    _opaque("F8_E5M2FNUZ", "u1", "float8_e5m2fnuz"),
    _opaque("F8_E8M0", "u1", "float8_e8m0fnu"),
    _opaque("FLOAT4_E2M1FN_X2", "u1", "float4_e2m1fn_x2"),  # two FP4 values per byte
    _opaque("C32", "<u4", "complex32"),
    DType("C128", np.dtype("<c16"), "complex128"),
    _opaque("BCOMPLEX32", "<u4", "bcomplex32"),
    _opaque("BITS8", "u1", "bits8"),
    _opaque("BITS16", "<u2", "bits16"),
    _opaque("BITS1X8", "u1", "bits1x8"),
    _opaque("BITS2X4", "u1", "bits2x4"),
    _opaque("BITS4X2", "u1", "bits4x2"),
    *(_opaque(f"INT{n}", "u1", f"int{n}") for n in range(1, 8)),  # one element per byte
    *(_opaque(f"UINT{n}", "u1", f"uint{n}") for n in range(1, 8)),
)
BY_NAME = {d.name: d for d in DTYPES}
_BY_NUMPY = {(d.raw.kind, d.raw.itemsize): d for d in DTYPES if d.numpy_native}
# ml_dtypes' extension types (what JAX uses), recognised by name so that
# ml_dtypes need not be a dependency. (Its float4_e2m1fn holds one value per
# byte, not torch's two: it has no counterpart here.)
_BY_NUMPY_NAME = {
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
NUMPY_SUPPORTED = (
    "numpy's bool, int8-64, uint8-64, float16/32/64 and complex64/128, and ml_dtypes' "
    + ", ".join(_BY_NUMPY_NAME)
)
# Signed integers of each width: torch's and numpy's oldest bit-holders, which
# every dtype of that width can be viewed as.
_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def torch_module() -> Any | None:
    """Return torch if it is installed (importing it if needed), else None."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _imported_torch() -> Any | None:
    """Return torch only if the process already imported it."""
    return sys.modules.get("torch")


def loaded_torch() -> Any:
    """Return torch where a torch tensor proves it is imported."""
    torch = sys.modules.get("torch")
    if torch is None:  # pragma: no cover - only reached with torch tensors in hand
        raise RuntimeError("torch is not imported")
    return torch


@dataclass
class Leaf:
    """One tensor to save: its table entry and the object that holds its data."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    value: Any  # np.ndarray (possibly strided) or a detached torch.Tensor
    kind: Literal["numpy", "torch"]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the region."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def is_cuda(self) -> bool:
        """Whether the data lives on a CUDA device (copied by DMA)."""
        return self.kind == "torch" and self.value.device.type == "cuda"


def make_leaf(name: str, value: Any) -> Leaf:
    """Check one state value and describe it for the tensor table.

    Raises:
        TypeError: the value is not an array or tensor, or its dtype or
            layout cannot be stored.
    """
    torch = _imported_torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return _torch_leaf(torch, name, value)
    if isinstance(value, (np.ndarray, np.generic)):
        return _numpy_leaf(name, np.asarray(value))
    raise TypeError(
        f"{name!r} is a {type(value).__module__}.{type(value).__qualname__}; state values must be "
        "numpy arrays or torch tensors (wrap Python scalars with numpy.asarray, or use "
        "ckptd.torch.save_state_dict for non-tensor values)"
    )


def _numpy_leaf(name: str, arr: np.ndarray) -> Leaf:
    dt = _BY_NUMPY.get((arr.dtype.kind, arr.dtype.itemsize))
    if dt is None and arr.dtype.name in _BY_NUMPY_NAME:
        dt = BY_NAME[_BY_NUMPY_NAME[arr.dtype.name]]
        arr = arr.view(dt.raw)  # keep the bits; numpy cannot convert these itself
    if dt is None:
        raise TypeError(
            f"{name!r} has numpy dtype {arr.dtype}, which ckptd cannot store ({NUMPY_SUPPORTED})"
        )
    return Leaf(name, dt, tuple(int(d) for d in arr.shape), arr, "numpy")


def _torch_leaf(torch: Any, name: str, t: torch.Tensor) -> Leaf:
    if t.is_quantized:
        raise TypeError(
            f"{name!r} is a quantized tensor ({t.dtype}), which ckptd cannot store: its "
            "scale and zero point are no tensor bytes. Save t.int_repr() with "
            "t.q_scale() and t.q_zero_point() (or the per-channel ones), or t.dequantize()"
        )
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        raise TypeError(
            f"{name!r} is a {t.layout} tensor; only dense (strided) tensors can be saved"
        )
    if t.device.type == "meta":
        raise TypeError(f"{name!r} is on the meta device and has no data to save")
    dt = _torch_dtypes(torch).get(t.dtype)
    if dt is None:
        raise TypeError(
            f"{name!r} has torch dtype {t.dtype}, which this ckptd client does not know "
            "(a torch newer than it?): save t.view(torch.uint8) and view it back after "
            "loading, or update ckptd"
        )
    return Leaf(name, dt, tuple(int(d) for d in t.shape), t.detach(), "torch")


@functools.cache  # one torch per process: built once, not once per tensor
def _torch_dtypes(torch: Any) -> dict[Any, DType]:
    """Map torch dtypes to ours; dtypes missing from an older torch are skipped."""
    out = {}
    for d in DTYPES:
        td = getattr(torch, d.torch_name, None)
        if td is not None:
            out[td] = d
    return out


def torch_dtype(torch: Any, dt: DType) -> Any:
    """The torch dtype for dt, or a clear error on a torch too old to have it."""
    td = getattr(torch, dt.torch_name, None)
    if td is None:
        raise TypeError(f"torch {torch.__version__} has no {dt.torch_name} (needed for {dt.name})")
    return td


def layout(leaves: list[Leaf]) -> int:
    """Assign region offsets in order and return the region size.

    Each tensor starts at a multiple of its element size (regions start on a
    page), so the region can be viewed with the tensor's own dtype; the gaps
    this leaves are at most 7 bytes, and only where the width shrinks.
    """
    end = 0
    for leaf in leaves:
        a = leaf.dtype.itemsize
        leaf.offset = (end + a - 1) // a * a
        end = leaf.offset + leaf.nbytes
    return end


def copy_in(leaf: Leaf, dst: np.ndarray, pin: Callable[[], bool]) -> bool:
    """Copy a leaf's elements into dst, a uint8 buffer of exactly leaf.nbytes.

    Host data is copied by numpy: one strided-aware pass on this thread (no
    temporary for non-contiguous sources); a save's leaves go through
    _copy.copy instead (host_pair), which spreads them over a few threads.
    A CUDA tensor is copied by torch with non_blocking=True when pin() says
    the destination is registered with CUDA; the caller must then
    synchronize before handing the bytes on, and the return value says so.
    """
    if leaf.nbytes == 0:
        return False
    if on_device(leaf):
        return _copy_from_device(leaf, dst, pin)
    np.copyto(*host_pair(leaf, dst), casting="equiv")
    return False


def on_device(leaf: Leaf) -> bool:
    """Whether leaf's elements are in a device's memory, not the host's."""
    return leaf.kind == "torch" and leaf.value.device.type != "cpu"


def host_pair(leaf: Leaf, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (destination, source) arrays whose np.copyto copies host leaf into dst.

    dst is a uint8 buffer of exactly leaf.nbytes; the source is a view of
    the leaf's own elements (no copy).
    """
    src = leaf.value if leaf.kind == "numpy" else _host_numpy(leaf.value, leaf.dtype)
    return dst.view(src.dtype.newbyteorder("<")).reshape(leaf.shape), src


def _host_numpy(t: torch.Tensor, dt: DType) -> np.ndarray:
    """A numpy view of a CPU tensor's elements (no copy unless lazily conjugated)."""
    if t.is_complex():
        t = t.resolve_conj()
    t = t.resolve_neg()
    if not dt.numpy_native:  # numpy sees the same bits as ints
        t = bits(loaded_torch(), t)
    return t.numpy()


def bits(torch: Any, t: torch.Tensor) -> torch.Tensor:
    """The tensor viewed as the signed integers of its width, if it has one (no copy).

    Copies through these are bit-exact for every dtype, also those torch
    cannot copy itself (its int1-7 and uint1-7).
    """
    name = _INT_OF_WIDTH.get(t.element_size())
    return t if name is None or t.dtype == getattr(torch, name) else t.view(getattr(torch, name))


def _copy_from_device(leaf: Leaf, dst: np.ndarray, pin: Callable[[], bool]) -> bool:
    torch = loaded_torch()
    out = torch.from_numpy(dst).view(torch_dtype(torch, leaf.dtype)).view(leaf.shape)
    asynchronous = leaf.is_cuda and pin()
    bits(torch, out).copy_(bits(torch, leaf.value), non_blocking=asynchronous)
    return asynchronous


def numpy_out(
    dt: DType, shape: tuple[int, ...], src: np.ndarray, later: list[Any] | None = None
) -> np.ndarray:
    """Copy src (the tensor's bytes, maybe unaligned) into a new array.

    The result owns its memory: the region it came from is released as soon
    as load returns. With later, the copy is not made but appended to it as
    a (destination, source) pair, for the caller to make (all of a load's
    together, on a few threads) before it releases the region.
    """
    if src.size == 0:
        return np.zeros(shape, dt.raw)
    out = np.empty(src.size, np.uint8)
    if later is None:
        np.copyto(out, src)
    else:
        later.append((out, src))
    return out.view(dt.raw).reshape(shape)


def torch_out(
    torch: Any,
    dt: DType,
    shape: tuple[int, ...],
    src: np.ndarray,
    device: Any,
    pinned: bool,
    later: list[Any] | None = None,
) -> Any:
    """Copy src into a new torch tensor on device (torch is the module, passed in).

    Bytes are copied as uint8 and reinterpreted on arrival, because restored
    tensors are packed back to back and may be unaligned for their dtype.
    later: as numpy_out's, for a tensor on the CPU.
    """
    td = torch_dtype(torch, dt)
    if src.size == 0:
        return torch.empty(shape, dtype=td, device=device)  # zeros cannot fill every dtype
    if device.type == "cpu":
        flat = numpy_out(BY_NAME["U8"], (src.size,), src, later)
        return torch.from_numpy(flat).view(td).view(shape)
    out = torch.empty(src.size, dtype=torch.uint8, device=device)
    out.copy_(torch.from_numpy(src), non_blocking=pinned)
    return out.view(td).view(shape)


def into_out(
    torch: Any,
    dt: DType,
    shape: tuple[int, ...],
    src: np.ndarray,
    dest: Any,
    pinned: bool,
    later: list[Any],
) -> bool:
    """Copy src into dest, an existing tensor or array, if it is one of dt and shape.

    dest must be dense and writable: a C-contiguous numpy array of dt
    (numpy's own types only), or a contiguous torch tensor of dt on the CPU
    or a CUDA device that is neither a view of another dtype's nor needs
    grad recorded. Its bytes are replaced in place: a host destination's
    copy is appended to later (as numpy_out's); a CUDA one is copied from
    src, asynchronously when pinned (the caller synchronizes). False, and
    nothing copied, when dest is not such a destination: the caller makes
    a new tensor instead.
    """
    if isinstance(dest, np.ndarray):
        if not (
            dt.numpy_native
            and dest.dtype == dt.raw
            and dest.shape == shape
            and dest.flags.c_contiguous
            and dest.flags.writeable
            and dest.nbytes == src.size
        ):
            return False
        if src.size:
            later.append((dest.reshape(-1).view(np.uint8), src))
        return True
    if torch is None or not isinstance(dest, torch.Tensor):
        return False
    if (
        dest.dtype != torch_dtype(torch, dt)
        or tuple(dest.shape) != shape
        or not dest.is_contiguous()
        or dest.requires_grad
        or dest.device.type not in ("cpu", "cuda")
        or type(dest) is not torch.Tensor  # a DTensor or another subclass
        or dest.is_conj()
        or dest.is_neg()
        or dest.numel() * dest.element_size() != src.size
    ):
        return False
    if src.size == 0:
        return True
    flat = dest.view(-1).view(torch.uint8)
    if dest.device.type == "cpu":
        later.append((flat.numpy(), src))
    else:
        flat.copy_(torch.from_numpy(src), non_blocking=pinned)
    return True


def default_out(
    dt: DType, shape: tuple[int, ...], src: np.ndarray, later: list[Any] | None = None
) -> Any:
    """A restored tensor for load's default (numpy) mode (later: as numpy_out's).

    numpy has no bfloat16, float8, float4, complex32 or torch's bit and
    sub-byte types: those come back as torch tensors when torch is
    installed, else as their raw bits (unsigned integer arrays).
    """
    arr = numpy_out(dt, shape, src, later)
    if dt.numpy_native:
        return arr
    torch = torch_module()
    if torch is None:
        return arr
    signed = arr.view(np.dtype(_INT_OF_WIDTH[dt.itemsize]))  # torch's oldest bit-holders
    return torch.from_numpy(signed).view(torch_dtype(torch, dt))
