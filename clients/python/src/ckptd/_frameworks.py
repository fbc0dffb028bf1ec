"""What the framework adapters (ckptd.lightning, ckptd.hf, ckptd.accelerate) share.

A framework's checkpoint is a model state dict plus everything else:
optimizer and scheduler states, loop counters, callbacks' states, RNG
states, hyper-parameters. Each adapter stores it as one ckptd step through
ckptd.torch's format -- the model's tensors as ``model:<name>`` (so ``ckptd
export`` finds them), everything else as ``extra`` -- and loads it back
with the helpers here.

ckptd.torch stores tensors, containers and JSON scalars, never pickle.
Frameworks put other objects in their checkpoints too (Lightning the class
of the hyper-parameters, accelerate's custom objects may hold anything):
those leaves are pickled into bytes under a one-key dict, and unpickled on
load only when the caller allows it -- what torch.load's ``weights_only``
decides for the framework's own files.
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from . import _names, _sharding, _tensors
from . import torch as ct
from ._client import Client
from ._errors import AlreadyExistsError, CkptdError, NotFoundError
from ._handle import SaveHandle, SaveStatus

PICKLED = "ckptd.pickled"
REF = "ckptd.tensor"
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_TYPES = (torch.dtype, torch.device, torch.Size)
_SMALL = 4096  # bytes: tensors up to this size are compared by value


def missing(module: str, extra: str, err: ImportError) -> ImportError:
    """The ImportError an adapter raises when its framework is not installed."""
    out = ImportError(
        f"ckptd.{module} needs {err.name or 'its framework'}, which is not installed: "
        f"pip install 'ckptd[{extra}]'"
    )
    out.name = err.name
    return out


def portable(obj: Any) -> dict[str, Any]:
    """Make obj storable by ckptd.torch under short names, whatever its keys.

    Its tensors, arrays and numpy scalars go into a list (stored as
    ``extra:tensors:<i>``: a checkpoint's keys -- a callback's repr, a file
    path -- can make names longer than the daemon takes), each replaced by
    {REF: i}; leaves ckptd.torch cannot store are pickled under {PICKLED:
    bytes}. unportable() undoes it.
    """
    found: list[Any] = []
    return {"tree": _portable(obj, found), "tensors": found}


def _portable(obj: Any, found: list[Any]) -> Any:
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        found.append(obj)
        return {REF: len(found) - 1}
    if isinstance(obj, _PLAIN_TYPES) or type(obj) in _PLAIN:
        return obj
    if isinstance(obj, Mapping):
        return {k: _portable(v, found) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_portable(v, found) for v in obj)
    return {PICKLED: pickle.dumps(obj)}


def unportable(stored: Any, allow_pickle: bool, where: str = "checkpoint") -> Any:
    """What portable() was given, the pickled leaves unpickled if allowed."""
    return _unportable(stored["tree"], list(stored["tensors"]), allow_pickle, where)


def _unportable(obj: Any, found: list[Any], allow_pickle: bool, where: str) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and isinstance(obj.get(REF), int):
            return found[obj[REF]]
        if len(obj) == 1 and isinstance(obj.get(PICKLED), bytes):
            if not allow_pickle:
                raise CkptdError(
                    f"{where} holds a pickled {_pickled_type(obj[PICKLED])}, which loading "
                    "with weights_only=True does not unpickle; load it with "
                    "weights_only=False if you trust the checkpoint"
                )
            return pickle.loads(obj[PICKLED])  # allowed by the caller, as torch.load
        return {k: _unportable(v, found, allow_pickle, f"{where}[{k!r}]") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(
            _unportable(v, found, allow_pickle, f"{where}[{i}]") for i, v in enumerate(obj)
        )
    return obj


def _pickled_type(blob: bytes) -> str:
    """The class a pickle names first, for an error message (without unpickling)."""
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name in ("GLOBAL", "STACK_GLOBAL") and arg:
                return str(arg).replace(" ", ".")
            if op.name == "SHORT_BINUNICODE" and isinstance(arg, str) and "." in arg:
                return arg
    except ValueError:
        pass
    return "object"


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a structure of dicts, lists and tuples, with its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}/{i}")


def identity(obj: Any) -> dict[str, Any]:
    """What each tensor of obj is, to tell later whether any changed.

    A large tensor is known by its memory and its version counter (torch
    bumps a tensor's _version at every in-place change, through any view of
    it); a small one (a score, a step count) by a copy of its value, since
    frameworks make those anew for each checkpoint.
    """
    out: dict[str, Any] = {}
    for path, t in tensors(obj):
        if ct._is_dtensor(t):  # its piece on this rank (comparing DTensors is a collective)
            d: Any = t
            local = d.to_local()
            out[path] = (local.data_ptr(), local._version, tuple(local.shape), repr(d.placements))
        elif t.numel() * t.element_size() <= _SMALL:
            out[path] = t.detach().to("cpu", copy=True)
        else:
            out[path] = (t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride(), t.device)
    return out


def same_identity(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether two identity() results say the same tensors, unchanged."""
    if a is None or list(a) != list(b):  # in order: portable() numbers them so
        return False
    for path, x in a.items():
        y = b[path]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if not torch.equal(_tensors.bits(torch, x), _tensors.bits(torch, y)):
                return False
        elif x != y:
            return False
    return True


@dataclass
class Loaded:
    """A step saved through ckptd.torch, decoded without a module to load into."""

    model: dict[str, Any]
    optimizer: Any
    extra: Any
    step: int


_RESERVED = (ct.SKELETON, ct.HF_CONFIG, _sharding.TENSOR)


def same_shard(
    client: Client,
    step: int,
    *,
    rank: int,
    job: str | None,
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None,
    extra: Any,
) -> str | None:
    """None when rank's stored shard of step holds these tensors, bit for bit.

    Else the name of the first that differs. What is compared is what
    ckptd.torch.save_state_dict would store for them -- a DTensor's local
    piece on this rank -- so no collective is needed.
    """
    packer = ct._Packer()
    packer.encode(model, ("model",))
    if optimizer is not None:
        packer.encode(optimizer, ("optimizer",))
    packer.encode(extra, ("extra",))
    now = {n: v for n, v in _names.flatten(packer.tree) if n not in _RESERVED}
    loaded = client.load(step, rank=rank, job=job, as_torch=True, nested=False)
    stored = {n: v for n, v in loaded.items() if n not in _RESERVED}
    if now.keys() != stored.keys():
        return next(iter(sorted(now.keys() ^ stored.keys())))
    for name, value in now.items():
        x, y = torch.as_tensor(value).detach().cpu(), stored[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return name
        if not torch.equal(_tensors.bits(torch, x), _tensors.bits(torch, y)):
            return name
    return None


def load(
    client: Client,
    step: int | Literal["latest"],
    *,
    job: str | None,
    rank: int = 0,
    extra_skeleton: Any = None,
    device: Any = None,
) -> Loaded:
    """Load rank's shard of a step saved through ckptd.torch.

    extra_skeleton, when given, decodes extra instead of the step's own
    (a pointer file's view of the same tensors). Tensors are on the CPU;
    the model's are moved to device when one is given.
    """
    source = ct._Source(client, step, rank, job)
    skeleton = ct._skeleton(source.state)
    unpacker = ct._Unpacker(source.state, source)
    model = unpacker.decode(skeleton["model"])
    optimizer = None if skeleton["optimizer"] is None else unpacker.decode(skeleton["optimizer"])
    extra = unpacker.decode(skeleton["extra"] if extra_skeleton is None else extra_skeleton)
    if device is not None:
        model = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model.items()}
    return Loaded(model, optimizer, extra, int(source.state.step))


def settle_earlier_run(
    client: Client, step: int, *, rank: int, job: str | None, timeout: float | None
) -> None:
    """Wait while the daemon drains a save of step that an earlier run made.

    A trainer killed right after staging step leaves that save to the
    daemon; a resumed run that saves step again before it commits would
    lose to it only after its own save was accepted (AlreadyExistsError
    from the handle, when the state is gone and cannot be compared). So a
    run that resumed waits here first: until that save commits (then
    stage() finds the step committed and compares), fails, or is durable
    while the earlier run's other ranks never came (then this save goes
    ahead). Nothing known of step returns at once (one round trip).
    """
    h = client.handle(step, rank=rank, job=job, attempt="")
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        h.wait(0.5)
        return  # committed: stage() compares
    except TimeoutError:
        pass  # known to the daemon and still running
    except CkptdError:
        return  # unknown (NotFoundError), or failed: this save goes ahead
    while deadline is None or time.monotonic() < deadline:
        status = h.status
        if status not in (SaveStatus.STAGED, SaveStatus.DRAINING):
            return  # committed, failed, or waiting for ranks that died
        time.sleep(0.05)


def stage(
    client: Client,
    step: int,
    model: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: Mapping[str, Any] | None,
    extra: Any,
    rank: int,
    world_size: int,
    job: str | None,
    timeout: float | None,
    resumed: bool = False,
) -> SaveHandle | None:
    """Save rank's shard of step through ckptd.torch; None when an earlier run committed it.

    A step an earlier run of the job committed (a trainer that resumed from
    an older step than the newest, which it retrains) is taken as this
    save when it holds the same tensors, bit for bit; else CkptdError.
    resumed: this process resumed from a step, so an earlier run's save of
    step may still be draining (see settle_earlier_run).
    """
    if resumed:
        settle_earlier_run(client, step, rank=rank, job=job, timeout=timeout)
    try:
        return ct.save_state_dict(
            client, step, model, optimizer=optimizer, extra=extra, rank=rank,
            world_size=world_size, job=job,
        )  # fmt: skip
    except AlreadyExistsError as exists:
        if exists.reason != "STEP_COMMITTED":
            raise
        attempt = str((exists.metadata or {}).get("attempt", ""))
        wait_committed(client, step, job=job, attempt=attempt, timeout=timeout)
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        differs = same_shard(
            client, step, rank=rank, job=job, model=sd, optimizer=optimizer, extra=extra
        )
        if differs is not None:
            raise CkptdError(
                f"step {step} was committed by an earlier run of the job (attempt {attempt}) "
                f"with other values ({differs} differs); ckptd keeps one state per step: "
                "resume from the newest committed step, or save under another job"
            ) from exists
        return None


def extra_skeleton(extra: Any) -> Any:
    """The skeleton ckptd.torch.save_state_dict writes for extra (tensor paths only)."""
    return ct._Packer().encode(extra, ("extra",))


def wait_committed(
    client: Client,
    step: int,
    *,
    job: str | None,
    attempt: str,
    timeout: float | None,
    rank: int = 0,
) -> None:
    """Return once step is committed; a save of it (rank's) still draining is waited for."""
    if any(s.step == step for s in client.steps(job)):
        return
    try:
        client.handle(step, rank=rank, job=job, attempt=attempt).wait(timeout)
    except NotFoundError:
        if not any(s.step == step for s in client.steps(job)):
            raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write obj as JSON to path atomically (a temporary file renamed over it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, separators=(",", ":")))  # dumps: C encoder, dump: Python
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def agree(step: int | None) -> int | None:
    """Rank 0's step on every rank (a commit may land between two ranks' looks)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return step
    box = [step]
    dist.broadcast_object_list(box, src=0)
    return box[0]
