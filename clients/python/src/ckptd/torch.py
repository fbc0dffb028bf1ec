"""Save and restore a torch model, its optimizer and extra values, bit-exactly.

A shard holds tensors only, but an optimizer's state dict has int keys,
tuples and floats (``param_groups``), and a trainer's extra state has RNG
states and loader positions. So these helpers split everything into

- the tensors (and numpy arrays), saved as ordinary shard tensors named by
  their path -- ``model:fc.weight``, ``optimizer:state:0:exp_avg``,
  ``extra:rng:torch`` -- so ``ckptd restore`` output stays readable; and
- a JSON skeleton of everything else, with a reference in place of each
  tensor, saved as one uint8 tensor named ``ckptd.torch``.

JSON rather than pickle, so that loading a checkpoint never runs code from
it. Python floats round-trip exactly through JSON (repr is shortest exact),
tuples and non-str keys are tagged, so what comes back is equal, type for
type, to what was saved.

Saves carry an attempt shared by the ranks of a run. When neither the
caller (``attempt=``, ``Client(attempt=...)``) nor ``$CKPTD_ATTEMPT`` names
one and torch.distributed is initialized, rank 0 makes a random one and
broadcasts it over the default group, once per process group.
"""

from __future__ import annotations

import base64
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from . import _attempt, _ranks
from ._client import Client
from ._dataset import DatasetSpec
from ._errors import CkptdError
from ._handle import SaveHandle
from ._torch_data import Batch, BatchDict, CkptdIterableDataset

__all__ = [
    "Batch",
    "BatchDict",
    "CkptdIterableDataset",
    "DatasetSpec",
    "load_state_dict",
    "save_state_dict",
]

SKELETON = "ckptd.torch"
FORMAT = 1
# A Hugging Face model's config.json, saved with it so that `ckptd export`
# writes a folder from_pretrained loads.
HF_CONFIG = "hf.config.json"


def save_state_dict(
    client: Client,
    step: int,
    model: torch.nn.Module | Mapping[str, Any],
    *,
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    extra: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    metadata: bytes = b"",
    job: str | None = None,
    attempt: str | None = None,
) -> SaveHandle:
    """Stage a model, optimizer and extra state as one shard; see Client.save.

    Args:
        client: a connected ckptd.Client.
        step: the training step.
        model: a module, or its state dict.
        optimizer: an optimizer, or its state dict.
        extra: anything built of tensors, numpy arrays, dicts, lists, tuples,
            str, int, float, bool, None and bytes: RNG states, the data
            loader's position, the epoch.
        rank: as Client.save: default torch.distributed's rank when it is
            initialized, else $RANK (see Client.save).
        world_size: as Client.save: default torch.distributed's world
            size, else $WORLD_SIZE.
        metadata: as Client.save.
        job: as Client.save.
        attempt: as Client.save; see below.

    Without an attempt given (attempt=, Client(attempt=...) or
    $CKPTD_ATTEMPT), a save whose world_size is torch.distributed's world
    size uses the run's attempt: rank 0 makes it and broadcasts it over the
    default group at the first such save of the process group (a collective
    call: every rank saves that step), and later saves reuse it. Other saves
    use the client's own attempt.

    Returns:
        The save's handle; wait() on it for durability.
    """
    packer = _Packer()
    model_sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    optim_sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    skeleton = {
        "format": FORMAT,
        "torch": torch.__version__,
        "model": packer.encode(model_sd, ("model",)),
        "model_metadata": _module_metadata(model_sd),
        "optimizer": None if optim_sd is None else packer.encode(optim_sd, ("optimizer",)),
        "extra": packer.encode(extra, ("extra",)),
    }
    blob = json.dumps(skeleton, separators=(",", ":")).encode()
    packer.tree[SKELETON] = np.frombuffer(blob, dtype=np.uint8)
    hf_config = _hf_config(model)
    if hf_config is not None:
        packer.tree[HF_CONFIG] = np.frombuffer(hf_config, dtype=np.uint8)
    rank, world_size = _ranks.resolve(rank, world_size)
    if attempt is None and client._attempt_random:
        attempt = _run_attempt(world_size)
    return client.save(
        step,
        packer.tree,
        rank=rank,
        world_size=world_size,
        metadata=metadata,
        job=job,
        attempt=attempt,
    )


def load_state_dict(
    client: Client,
    step: int | Literal["latest"],
    model: torch.nn.Module | None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rank: int | None = None,
    job: str | None = None,
) -> Any:
    """Restore what save_state_dict saved into model and optimizer.

    Args:
        client: a connected ckptd.Client.
        step: the step to load, or "latest" for the newest committed one.
        model: the module to load into (None: skip the model).
        optimizer: the optimizer to load into (None: skip it). It must be
            built over the same parameters, in the same order, as the saved one.
        strict: passed to Module.load_state_dict.
        rank: which rank's shard (default: this process's, as Client.load).
        job: as Client.load.

    Returns:
        extra, as saved. Its tensors are on the CPU (RNG states must be).

    Raises:
        CkptdError: the step was not saved by save_state_dict.
        ValueError: an optimizer was given but the checkpoint has none.
    """
    state = client.load(step, rank=rank, job=job, as_torch=True)
    skeleton = _skeleton(state)
    unpacker = _Unpacker(state)
    if model is not None:
        sd = unpacker.decode(skeleton["model"])
        model_sd = OrderedDict(sd)
        if skeleton.get("model_metadata") is not None:
            model_sd._metadata = unpacker.decode(skeleton["model_metadata"])  # type: ignore[attr-defined]
        model.load_state_dict(model_sd, strict=strict)
    if optimizer is not None:
        if skeleton["optimizer"] is None:
            raise ValueError(f"step {state.step} was saved without an optimizer state")
        optimizer.load_state_dict(unpacker.decode(skeleton["optimizer"]))
    return unpacker.decode(skeleton["extra"])


def _skeleton(state: Mapping[str, Any]) -> dict[str, Any]:
    blob = state.get(SKELETON)
    if blob is None:
        raise CkptdError(
            f"step {getattr(state, 'step', '?')} was not saved with ckptd.torch.save_state_dict "
            f"(it has no {SKELETON!r} tensor); load it with Client.load"
        )
    skeleton: dict[str, Any] = json.loads(blob.numpy().tobytes())
    if skeleton.get("format") != FORMAT:
        raise CkptdError(
            f"unknown ckptd.torch format {skeleton.get('format')!r} (this client reads {FORMAT})"
        )
    return skeleton


def _hf_config(model: Any) -> bytes | None:
    """A transformers model's full config.json, or None for other models."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if not isinstance(model, torch.nn.Module) or not callable(to_json):
        return None
    text = to_json(use_diff=False)
    return text.encode() if isinstance(text, str) else None


def _module_metadata(sd: Mapping[str, Any]) -> Any:
    """Module versions that load_state_dict hands to _load_from_state_dict."""
    meta = getattr(sd, "_metadata", None)
    return None if meta is None else _Packer().encode(dict(meta), ("_metadata",))


class _Packer:
    """Splits a structure into a tensor tree and a JSON-able skeleton."""

    def __init__(self) -> None:
        self.tree: dict[str, Any] = {}
        self._used: dict[tuple[str, ...], set[str]] = {}

    def _segment(self, parent: tuple[str, ...], key: Any) -> tuple[str, ...]:
        """A path segment for key, unique within its parent (1 and "1" differ)."""
        base = key if isinstance(key, str) else str(key)
        base = base or "~"
        used = self._used.setdefault(parent, set())
        seg, n = base, 1
        while seg in used:
            seg, n = f"{base}~{n}", n + 1
        used.add(seg)
        return (*parent, seg)

    def _place(self, path: tuple[str, ...], value: Any) -> list[str]:
        node = self.tree
        for seg in path[:-1]:
            node = node.setdefault(seg, {})
        node[path[-1]] = value
        return list(path)

    def encode(self, obj: Any, path: tuple[str, ...]) -> Any:  # noqa: PLR0911 - one case per type
        """Return obj's skeleton, moving its tensors into the tree."""
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"T": "tensor", "p": self._place(path, obj)}
        if isinstance(obj, np.ndarray):
            return {"T": "ndarray", "p": self._place(path, obj)}
        if isinstance(obj, np.generic):
            return {"T": "npscalar", "p": self._place(path, np.asarray(obj))}
        if isinstance(obj, Mapping):
            keys = list(obj.keys())
            return {
                "T": "dict",
                "k": [self._key(k, path) for k in keys],
                "v": [self.encode(obj[k], self._segment(path, k)) for k in keys],
            }
        if isinstance(obj, (list, tuple)):
            tag = (
                "size"
                if isinstance(obj, torch.Size)
                else "list"
                if isinstance(obj, list)
                else "tuple"
            )
            return {
                "T": tag,
                "v": [self.encode(v, self._segment(path, i)) for i, v in enumerate(obj)],
            }
        if isinstance(obj, (bytes, bytearray)):
            return {"T": "bytes", "v": base64.b64encode(bytes(obj)).decode()}
        if isinstance(obj, torch.dtype):
            return {"T": "dtype", "v": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"T": "device", "v": str(obj)}
        raise TypeError(
            f"{':'.join(path)} is a {type(obj).__qualname__}, which ckptd.torch cannot store "
            "(tensors, arrays, dicts, lists, tuples, str, int, float, bool, None, bytes); "
            "convert it, or serialise it to bytes yourself"
        )

    def _key(self, key: Any, path: tuple[str, ...]) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)):
            return key
        if isinstance(key, tuple):
            return {"T": "tuple", "v": [self._key(k, path) for k in key]}
        raise TypeError(
            f"a key of {':'.join(path)} is a {type(key).__qualname__}; keys must be scalars"
        )


class _Unpacker:
    """Rebuilds a structure from its skeleton and the loaded tensor tree."""

    def __init__(self, tree: Mapping[str, Any]) -> None:
        self.tree = tree

    def _get(self, path: list[str]) -> Any:
        node: Any = self.tree
        try:
            for seg in path:
                node = node[seg]
        except (KeyError, TypeError):
            raise CkptdError(
                f"checkpoint is missing tensor {':'.join(path)} named by its skeleton"
            ) from None
        return node

    def decode(self, node: Any) -> Any:  # noqa: PLR0911 - one case per tag
        """Return the object node describes."""
        if not isinstance(node, dict):
            return node
        tag = node["T"]
        if tag == "tensor":
            return self._get(node["p"])
        if tag == "ndarray":
            return self._get(node["p"]).numpy()
        if tag == "npscalar":
            return self._get(node["p"]).numpy()[()]
        if tag == "dict":
            return {
                self.decode(k): self.decode(v) for k, v in zip(node["k"], node["v"], strict=True)
            }
        if tag == "list":
            return [self.decode(v) for v in node["v"]]
        if tag == "tuple":
            return tuple(self.decode(v) for v in node["v"])
        if tag == "size":
            return torch.Size(self.decode(v) for v in node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"])
        if tag == "dtype":
            return getattr(torch, node["v"])
        if tag == "device":
            return torch.device(node["v"])
        raise CkptdError(f"unknown tag {tag!r} in a ckptd.torch skeleton")


class _RunAttempt:
    """The attempt rank 0 broadcast, and the default process group it went over.

    A new group (an in-process restart) gets a new attempt.
    """

    lock = threading.Lock()
    group: weakref.ReferenceType[Any] | None = None
    attempt = ""


def _run_attempt(world_size: int) -> str | None:
    """The attempt every rank of the torch.distributed run shares, or None.

    None when torch.distributed is not initialized, or when the attempt is
    not agreed yet and this save's world_size is not the default group's
    size: then not every rank saves, and a broadcast would wait forever.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD
    run = _RunAttempt
    with run.lock:
        if run.group is not None and run.group() is group:
            return run.attempt
        if world_size != dist.get_world_size():
            return None
        mine = [_attempt.new() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(mine, src=0)
        run.attempt = _attempt.check(mine[0], "the attempt rank 0 broadcast")
        run.group = weakref.ref(group)
        return run.attempt
