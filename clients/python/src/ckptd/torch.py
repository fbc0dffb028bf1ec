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

DTensors (FSDP2's ``fully_shard``, ``distribute_tensor``) are stored as
each rank's local piece, named as the ``ckptd.sharding`` convention says
(``model:<fqn>``, ``optimizer:state.0.exp_avg``), with a description of
where each piece lies in its global tensor (_sharding.py); ``ckptd export``
reads it. Loading at another world size (or into an unsharded model)
assembles each target's region from the overlapping saved pieces of every
rank; at the same layout each rank reads only its own shard.

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
from dataclasses import dataclass
from math import prod
from typing import Any, Literal

import numpy as np
import torch

from . import _attempt, _names, _ranks, _sharding, _tensors
from ._client import Client
from ._dataset import DatasetSpec
from ._elastic import gather_dataset_state
from ._errors import CkptdError, InvalidArgumentError, NotFoundError
from ._handle import SaveHandle
from ._preempt import Preemption, on_preemption
from ._torch_data import Batch, BatchDict, CkptdIterableDataset

# DTensors exist where torch.distributed does (not in every build of torch).
_DISTRIBUTED = torch.distributed.is_available()
if _DISTRIBUTED:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = [
    "Batch",
    "BatchDict",
    "CkptdIterableDataset",
    "DatasetSpec",
    "Preemption",
    "gather_dataset_state",
    "load_state_dict",
    "on_preemption",
    "save_state_dict",
]

SKELETON = "ckptd.torch"
# 1: tensors only; 2: DTensor pieces too, with a ckptd.sharding description.
# A save without DTensors is still written as format 1.
FORMAT = 2
FORMATS = (1, 2)
# A Hugging Face model's config.json, saved with it so that `ckptd export`
# writes a folder from_pretrained loads.
HF_CONFIG = "hf.config.json"
# The skeleton's key naming the rank whose shard holds the model and
# optimizer of a replicated (data-parallel) save: the other ranks store
# neither.
REPLICATED = "replicated_from"


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
    replicated: bool | None = None,
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
        replicated: the model and optimizer are the same on every rank (data
            parallel: DDP). Rank 0 then stores them and the other ranks
            store only their extra, so a step takes the room of one rank's
            state, not of world_size's; every rank loads them from rank 0's
            shard. None (default): true for a DistributedDataParallel
            module saved at a world size above 1, else false.

    Without an attempt given (attempt=, Client(attempt=...) or
    $CKPTD_ATTEMPT), a save whose world_size is torch.distributed's world
    size uses the run's attempt: rank 0 makes it and broadcasts it over the
    default group at the first such save of the process group (a collective
    call: every rank saves that step), and later saves reuse it. Other saves
    use the client's own attempt.

    DTensors (an FSDP2 model and its optimizer state, distribute_tensor)
    are saved as this rank's local piece, with where it lies in the global
    tensor; every rank must then save (a step is sharded on all its ranks
    or on none). A piece that other ranks hold too (they differ only in the
    DTensor's Replicate mesh dimensions: HSDP's replicas) is stored once, by
    the rank at 0 in those dimensions; the others' skeletons name it, and
    their load reads it from that rank's shard. Plain tensors beside them
    are taken to be replicated: rank 0's are the ones ``ckptd export`` uses.

    Returns:
        The save's handle; wait() on it for durability.
    """
    rank, world_size = _ranks.resolve(rank, world_size)
    if replicated is None:
        replicated = world_size > 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel)
    packer = _Packer(rank if _group_rank(rank, world_size) else None)
    model_sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    optim_sd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    skeleton = {
        "format": 1,
        "torch": torch.__version__,
        "model": packer.encode(model_sd, ("model",)),
        "model_metadata": _module_metadata(model_sd),
        "optimizer": None if optim_sd is None else packer.encode(optim_sd, ("optimizer",)),
        "extra": packer.encode(extra, ("extra",)),
    }
    if packer.sharded:
        if replicated:
            raise ValueError(
                "replicated=True with DTensors: a sharded state is not the same on every rank"
            )
        skeleton["format"] = FORMAT
        packer.tree[_sharding.TENSOR] = _sharding.encode(packer.description(rank == 0))
    if replicated and world_size > 1:
        # Rank 0's shard holds the model and optimizer for every rank; the
        # skeleton still describes them, for a load to find them there.
        skeleton[REPLICATED] = 0
        if rank != 0:
            packer.tree.pop("model", None)
            packer.tree.pop("optimizer", None)
    blob = json.dumps(skeleton, separators=(",", ":")).encode()
    packer.tree[SKELETON] = np.frombuffer(blob, dtype=np.uint8)
    hf_config = _hf_config(model)
    if hf_config is not None:
        packer.tree[HF_CONFIG] = np.frombuffer(hf_config, dtype=np.uint8)
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

    A replicated save (save_state_dict's replicated) loads its model and
    optimizer from the rank that stored them, at any world size; a rank
    beyond the saved world size gets rank 0's extra.

    A step saved with DTensors loads at any world size: each DTensor of
    the model's (and optimizer's) current state dict gets its local region,
    read from this rank's shard when it holds exactly that piece, else
    assembled from the pieces of every saved rank (each loaded once); a
    plain tensor there gets the whole tensor. A rank beyond the saved world
    size reads the skeleton and plain tensors of rank 0's shard. Optimizer
    state the optimizer does not have yet is sharded as its parameter is.

    The model's plain parameters and buffers of the saved dtype and shape
    are filled in place as the shard is read (Client.load's into), so the
    model is copied once and no second copy of it is held; others are
    loaded as new tensors and copied (or cast) by Module.load_state_dict.
    Should loading fail after the shard was read (a strict key mismatch,
    a step saved without save_state_dict), the model may hold the saved
    values of the tensors it shares with the step.

    Returns:
        extra, as saved. Its tensors are on the CPU (RNG states must be).

    Raises:
        CkptdError: the step was not saved by save_state_dict.
        ValueError: an optimizer was given but the checkpoint has none.
    """
    into = None if model is None else _in_place(model)
    source = _Source(client, step, rank, job, into)
    state = source.state
    skeleton = _skeleton(state)
    holder = skeleton.get(REPLICATED)
    if holder is not None and holder != source.rank:
        shared = client.load(state.step, rank=holder, job=job, as_torch=True, into=into)
        for group in ("model", "optimizer"):
            if group in shared:
                state[group] = shared[group]
    unpacker = _Unpacker(state, source)
    if model is not None:
        sd = unpacker.decode(skeleton["model"], model.state_dict())
        model_sd = OrderedDict(sd)
        if skeleton.get("model_metadata") is not None:
            model_sd._metadata = unpacker.decode(skeleton["model_metadata"])  # type: ignore[attr-defined]
        model.load_state_dict(model_sd, strict=strict)
    if optimizer is not None:
        if skeleton["optimizer"] is None:
            raise ValueError(f"step {state.step} was saved without an optimizer state")
        optimizer.load_state_dict(unpacker.decode(skeleton["optimizer"], _optim_like(optimizer)))
    return unpacker.decode(skeleton["extra"])


def _in_place(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's own tensors by stored name, for a load to copy straight into.

    Only a state dict entry that is one of the model's parameters or
    buffers (its memory, laid out the same) is taken: load_state_dict's
    copy of it onto that parameter is then no copy at all, so the model's
    state is copied once, not into new tensors first and then again. An
    entry a state dict hook made, a DTensor, or one of a dtype or shape
    other than the saved one is loaded as a new tensor, as before.
    """
    own = {
        (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride())
        for t in (*model.parameters(), *model.buffers())
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() > 0
    }
    plain = {
        k: v
        for k, v in model.state_dict().items()
        if type(v) is torch.Tensor
        and (v.data_ptr(), v.dtype, v.device, tuple(v.shape), v.stride()) in own
    }
    out: dict[str, torch.Tensor] = {}
    for k, v in plain.items():
        try:
            out.update(_names.flatten({"model": {k: v}}))
        except (TypeError, ValueError):  # a key no shard name can hold: not in any step
            continue
    return out


def _skeleton(state: Mapping[str, Any]) -> dict[str, Any]:
    blob = state.get(SKELETON)
    if blob is None:
        raise CkptdError(
            f"step {getattr(state, 'step', '?')} was not saved with ckptd.torch.save_state_dict "
            f"(it has no {SKELETON!r} tensor); load it with Client.load"
        )
    skeleton: dict[str, Any] = json.loads(blob.numpy().tobytes())
    if skeleton.get("format") not in FORMATS:
        raise CkptdError(
            f"unknown ckptd.torch format {skeleton.get('format')!r} "
            f"(this client reads {', '.join(map(str, FORMATS))})"
        )
    return skeleton


def _group_rank(rank: int, world_size: int) -> bool:
    """Whether rank and world_size are the default process group's.

    DTensor meshes name ranks in that group.
    """
    return (
        _DISTRIBUTED
        and torch.distributed.is_initialized()
        and torch.distributed.get_rank() == rank
        and torch.distributed.get_world_size() == world_size
    )


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


def _is_dtensor(obj: Any) -> bool:
    return _DISTRIBUTED and isinstance(obj, DTensor)


def _local_box(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local piece on this rank: its (shape, offsets) in the global tensor."""
    for p in t.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise TypeError(
                f"a DTensor placed {p!r} has no piece of its own on each rank; "
                "ckptd.torch stores Shard and Replicate placements (redistribute it first)"
            )
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(d) for d in shape), tuple(int(o) for o in offsets)


def _holder(t: Any) -> int | None:
    """The rank that stores t's local piece (None: this rank is not in t's mesh).

    Of the ranks holding the same piece (those differing only in t's
    Replicate mesh dimensions, as HSDP's replicas do), the one at 0 in each.
    """
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    held = [0 if isinstance(p, Replicate) else c for p, c in zip(t.placements, coord, strict=True)]
    return int(t.device_mesh.mesh[tuple(held)].item())


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same elements: memory, dtype and layout (None: never shared).

    Tied weights (an embedding and the output layer sharing one matrix)
    come out of a state dict as two tensors over one memory.
    """
    if t.numel() == 0 or t.is_meta or t.is_conj() or t.is_neg() or t.layout != torch.strided:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _Packer:
    """Splits a structure into a tensor tree and a JSON-able skeleton.

    A DTensor's local piece goes under ``<group>:<fqn>`` (its path after the
    group, joined with "."), as the ckptd.sharding convention names pieces,
    and pieces describes it.
    """

    def __init__(self, rank: int | None = None) -> None:
        """Start an empty tree.

        rank: the saving rank, when it is the default process group's rank;
        a replicated DTensor piece is then stored by one of the ranks
        holding it only (None: every rank stores its pieces).
        """
        self.tree: dict[str, Any] = {}
        self._used: dict[tuple[str, ...], set[str]] = {}
        self.pieces: dict[str, _sharding.Piece] = {}
        self.sharded = False  # a DTensor was encoded
        self._rank = rank
        self._plain: list[tuple[tuple[str, ...], torch.Tensor]] = []
        # Tensors placed, by their memory and layout: another entry that is
        # the same tensor (tied weights) refers to it instead of storing it
        # again.
        self._placed: dict[tuple[Any, ...], list[str]] = {}

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
        if _is_dtensor(obj):
            return self._dtensor(obj, path)
        if isinstance(obj, torch.Tensor):
            same = _alias_key(obj)
            if same in self._placed:
                return {"T": "tensor", "p": self._placed[same]}
            self._plain.append((path, obj))
            where = self._place(path, obj)
            if same is not None:
                self._placed[same] = where
            return {"T": "tensor", "p": where}
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

    def _dtensor(self, t: Any, path: tuple[str, ...]) -> dict[str, Any]:
        if len(path) < 2 or path[0] not in _sharding.GROUPS:
            raise TypeError(f"{':'.join(path)}: a DTensor must be inside model, optimizer or extra")
        group, fqn = path[0], ".".join(path[1:])
        self.sharded = True
        shape, offsets = _local_box(t)
        local = t.to_local().detach()
        local = _tensors.bits(torch, local).contiguous().view(local.dtype)  # any dtype
        if tuple(local.shape) != shape:
            raise ValueError(
                f"{':'.join(path)}: the local tensor is {tuple(local.shape)}, but its "
                f"placements {t.placements} give {shape}"
            )
        where = _sharding.key_path(group, fqn, None)
        if where != path:  # a nested path: the piece goes flat under its group
            used = self._used.setdefault(where[:1], set())
            if where[1] in used:
                raise ValueError(
                    f"{':'.join(path)} is stored as {where[0]}:{where[1]}, a name "
                    "another entry already has"
                )
            used.add(where[1])
        node: dict[str, Any] = {
            "T": "dtensor",
            "p": list(where),
            "s": [int(d) for d in t.shape],
            "pl": [repr(p) for p in t.placements],
            "m": [int(d) for d in t.device_mesh.shape],
        }
        holder = _holder(t) if self._rank is not None else None
        if holder is not None and holder != self._rank:
            node["h"] = holder  # an identical piece: that rank stores it
            return node
        self._place(where, local)
        self.pieces[_sharding.stored_name(where)] = _sharding.Piece(
            group, fqn, tuple(int(d) for d in t.shape), offsets
        )
        return node

    def description(self, with_plain: bool) -> dict[str, _sharding.Piece]:
        """The ckptd.sharding description of the pieces placed.

        with_plain: describe the plain model and optimizer tensors too, as
        whole tensors (on one rank: they are taken to be replicated).
        """
        out = dict(self.pieces)
        if not with_plain:
            return out
        taken = {(p.group, p.fqn) for p in out.values()}
        for path, t in self._plain:
            group, fqn = path[0], ".".join(path[1:])
            if group not in ("model", "optimizer") or len(path) < 2:
                continue
            if (group, fqn) in taken:
                raise ValueError(f"{':'.join(path)} and a DTensor are both {group} {fqn!r}")
            taken.add((group, fqn))
            shape = tuple(int(d) for d in t.shape)
            out[_sharding.stored_name(path)] = _sharding.Piece(group, fqn, shape, (0,) * len(shape))
        return out

    def _key(self, key: Any, path: tuple[str, ...]) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)):
            return key
        if isinstance(key, tuple):
            return {"T": "tuple", "v": [self._key(k, path) for k in key]}
        raise TypeError(
            f"a key of {':'.join(path)} is a {type(key).__qualname__}; keys must be scalars"
        )


class _Source:
    """The shards a load reads: this rank's (or rank 0's), and the others' on demand."""

    def __init__(
        self,
        client: Client,
        step: int | Literal["latest"],
        rank: int | None,
        job: str | None,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.client, self.job = client, job
        self.rank = _ranks.rank(rank)  # whose shard state is
        try:
            self.state = client.load(step, rank=self.rank, job=job, as_torch=True, into=into)
        except (NotFoundError, InvalidArgumentError) as missing:
            # A rank the step does not have (out of its world size): a
            # sharded step loads from rank 0's shard.
            try:
                state = client.load(step, rank=0, job=job, as_torch=True, into=into)
            except (NotFoundError, InvalidArgumentError):
                raise missing from None
            if _sharding.TENSOR not in state and REPLICATED not in _skeleton(state):
                raise
            self.state, self.rank = state, 0
        own = self.state.get(_sharding.TENSOR)
        self.described = {} if own is None else _sharding.decode(own)
        self._flat: dict[str, Any] | None = None
        self._index: dict[tuple[str, str], list[tuple[_sharding.Piece, torch.Tensor]]] | None = None
        self._held: dict[int, dict[str, tuple[_sharding.Piece, torch.Tensor]]] = {}

    def flat(self) -> dict[str, Any]:
        """The loaded shard's tensors by stored name."""
        if self._flat is None:
            self._flat = dict(_names.flatten(self.state))
        return self._flat

    def own(self, name: str) -> tuple[_sharding.Piece, torch.Tensor] | None:
        """The piece stored as name in the loaded shard, if described."""
        piece = self.described.get(name)
        return None if piece is None else (piece, self.flat()[name])

    def held(self, holder: int, name: str) -> tuple[_sharding.Piece, torch.Tensor] | None:
        """The piece stored as name by holder, which this rank's save left it to.

        Reads, once per holder, only the pieces this rank's skeleton leaves
        to it.
        """
        if holder not in self._held:
            names = sorted(_left_to(_skeleton(self.state), holder))
            shard = self.client.load(
                self.state.step,
                rank=holder,
                job=self.job,
                as_torch=True,
                nested=False,
                tensors=[_sharding.TENSOR, *names],
            )
            described = _sharding.decode(shard[_sharding.TENSOR])
            self._held[holder] = {n: (described[n], shard[n]) for n in names if n in described}
        return self._held[holder].get(name)

    def pieces(self, group: str, fqn: str) -> list[tuple[_sharding.Piece, torch.Tensor]]:
        """Every saved piece of (group, fqn), from every rank's shard."""
        if self._index is None:
            index: dict[tuple[str, str], list[tuple[_sharding.Piece, torch.Tensor]]] = {}
            for r in range(self.state.world_size):
                shard = (
                    self.flat()
                    if r == self.rank
                    else self.client.load(
                        self.state.step, rank=r, job=self.job, as_torch=True, nested=False
                    )
                )
                blob = shard.get(_sharding.TENSOR)
                if blob is None:
                    raise CkptdError(
                        f"step {self.state.step} rank {r} has no {_sharding.TENSOR} description, "
                        "which a step saved with DTensors has on every rank"
                    )
                for name, p in _sharding.decode(blob).items():
                    index.setdefault((p.group, p.fqn), []).append((p, shard[name]))
            self._index = index
        return self._index.get((group, fqn), [])

    def region(
        self,
        name: str,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        holder: int | None = None,
    ) -> torch.Tensor:
        """The box (offsets, shape) of the global tensor whose piece is name.

        The piece is stored in the loaded shard, or by holder (a replica
        saved once).
        """
        mine = self.own(name)
        if mine is None and holder is not None:
            mine = self.held(holder, name)
        if mine is None:
            raise CkptdError(
                f"{_sharding.TENSOR} does not describe {name!r}, which the skeleton names"
            )
        piece, tensor = mine
        if piece.offsets == offsets and tuple(tensor.shape) == shape:
            return tensor  # this rank's own piece: the layout did not change
        out = torch.empty(shape, dtype=tensor.dtype)
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        filled = 0
        for p, t in self.pieces(piece.group, piece.fqn):
            box = (p.offsets, tuple(t.shape))
            lo = [max(a, b) for a, b in zip(offsets, p.offsets, strict=True)]
            hi = [
                min(a + n, b + m)
                for a, n, b, m in zip(offsets, shape, p.offsets, t.shape, strict=True)
            ]
            if box in seen or any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                continue
            seen.add(box)
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offsets, strict=True))
            _tensors.bits(torch, out)[dst] = _tensors.bits(torch, t)[src]  # any dtype, bit for bit
            filled += prod(b - a for a, b in zip(lo, hi, strict=True))
        if filled != prod(shape):
            raise CkptdError(
                f"step {self.state.step}: the saved pieces of {piece.group} {piece.fqn!r} cover "
                f"{filled} of the {prod(shape)} elements at offsets {list(offsets)}, "
                f"shape {list(shape)}"
            )
        return out


@dataclass(frozen=True)
class _ParamState:
    """What an optimizer's state for one parameter should look like.

    Entries it has give their own layout; others are laid out as the
    parameter is (exp_avg, exp_avg_sq, momentum_buffer...).
    """

    state: Mapping[str, Any]
    param: torch.Tensor

    def get(self, key: Any) -> Any:
        return self.state.get(key, self.param)


def _optim_like(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The template a saved optimizer state is loaded against: its state per parameter."""
    sd = optimizer.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = sd["state"]
    return {
        "state": {i: _ParamState(state.get(i, {}), p) for i, p in zip(ids, params, strict=False)}
    }


def _child(like: Any, key: Any) -> Any:
    """The entry for key in like, or None."""
    if isinstance(like, (Mapping, _ParamState)):
        return like.get(key)
    if isinstance(like, (list, tuple)) and isinstance(key, int) and 0 <= key < len(like):
        return like[key]
    return None


class _Unpacker:
    """Rebuilds a structure from its skeleton and the loaded tensor tree.

    decode's like is the live structure being loaded into (a state dict):
    a DTensor there gets its local region, rebuilt as a DTensor like it.
    """

    def __init__(self, tree: Mapping[str, Any], source: _Source | None = None) -> None:
        self.tree = tree
        self.source = source

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

    def decode(self, node: Any, like: Any = None) -> Any:  # noqa: PLR0911 - one case per tag
        """Return the object node describes, laid out as like where like is a DTensor."""
        if not isinstance(node, dict):
            return node
        tag = node["T"]
        if tag == "tensor":
            return _as_like(self._get(node["p"]), like)
        if tag == "dtensor":
            return self._dtensor(node, like)
        if tag == "ndarray":
            return self._get(node["p"]).numpy()
        if tag == "npscalar":
            return self._get(node["p"]).numpy()[()]
        if tag == "dict":
            keys = [self.decode(k) for k in node["k"]]
            return {
                k: self.decode(v, _child(like, k)) for k, v in zip(keys, node["v"], strict=True)
            }
        if tag == "list":
            return [self.decode(v, _child(like, i)) for i, v in enumerate(node["v"])]
        if tag == "tuple":
            return tuple(self.decode(v, _child(like, i)) for i, v in enumerate(node["v"]))
        if tag == "size":
            return torch.Size(self.decode(v) for v in node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"])
        if tag == "dtype":
            return getattr(torch, node["v"])
        if tag == "device":
            return torch.device(node["v"])
        raise CkptdError(f"unknown tag {tag!r} in a ckptd.torch skeleton")

    def _dtensor(self, node: Mapping[str, Any], like: Any) -> torch.Tensor:
        """A saved DTensor: like's local region as a DTensor like it, else the whole tensor."""
        if self.source is None:
            raise CkptdError("a DTensor in a skeleton that has no pieces")
        name = _sharding.stored_name(node["p"])
        shape = tuple(int(d) for d in node["s"])
        holder = node.get("h")
        if _is_dtensor(like) and tuple(like.shape) == shape:
            local_shape, offsets = _local_box(like)
            return _from_local(self.source.region(name, offsets, local_shape, holder), like)
        return self.source.region(name, (0,) * len(shape), shape, holder)


def _left_to(node: Any, holder: int) -> set[str]:
    """The stored names of the DTensor pieces a skeleton leaves to holder."""
    if isinstance(node, list):
        return set().union(*(_left_to(v, holder) for v in node))
    if not isinstance(node, Mapping):
        return set()
    if node.get("T") == "dtensor":
        return {_sharding.stored_name(node["p"])} if node.get("h") == holder else set()
    return set().union(*(_left_to(v, holder) for v in node.values()))


def _from_local(local: torch.Tensor, like: Any) -> torch.Tensor:
    """A DTensor laid out as like, whose local piece is local."""
    out: torch.Tensor = DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
    return out


def _as_like(value: Any, like: Any) -> Any:
    """A whole saved tensor, cut to like's local region where like is a DTensor."""
    if not (_is_dtensor(like) and isinstance(value, torch.Tensor) and value.shape == like.shape):
        return value
    shape, offsets = _local_box(like)
    box = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
    local = _tensors.bits(torch, value)[box].contiguous().view(value.dtype)  # any dtype
    return _from_local(local, like)


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
