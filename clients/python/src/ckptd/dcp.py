"""torch.distributed.checkpoint (DCP) storage through the ckptd sidecar.

::

    import torch.distributed.checkpoint as dcp
    import ckptd.dcp

    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client, step=100))
    fut = dcp.async_save(sd, storage_writer=ckptd.dcp.Writer(client, step=200))
    dcp.load(sd, storage_reader=ckptd.dcp.Reader(client, step="latest"))

    # or the step in DCP's checkpoint_id, as frameworks pass it:
    dcp.save(sd, storage_writer=ckptd.dcp.Writer(client), checkpoint_id=".../step-300")
    dcp.load(sd, storage_reader=ckptd.dcp.Reader(client), checkpoint_id="ckptd://job/latest")
    # or a ckptd:// id alone (the node's daemon, at the default socket):
    dcp.save(sd, checkpoint_id="ckptd://job/step-400")

A Writer or Reader without a step takes each save's step from the
checkpoint_id DCP gives it (reset; parse_checkpoint_id says which ids name
a step); a step given both ways must agree, and an id naming none is an
error. async_save stages before DCP resets the writer, so stage() reads
the id, and the checkpointer type (PROCESS is refused: the Writer cannot
go to another process), from DCP's async_save call. DCP has no registry of
storages: importing this module wraps DCP's _storage_setup so that a
``ckptd://`` id given without a storage gets a Writer or Reader of a
Client() (one per process); see _find_ckptd_by_id.

A save of a step that is committed already raises AlreadyExistsError
(DCP's FileSystemWriter overwrites; a committed ckptd step never changes),
or with Writer(if_committed="keep") stores nothing and keeps the step.
Saves that give DCP no planner plan with DCP's plan caching on (keyed by
the process group): a save of the layout the last one had sends DCP empty
plans, and the coordinator reuses its global plan and metadata. DCP still
gathers and scatters those plans (its collective, which no storage hook
precedes).

DCP plans the checkpoint (DTensor / FSDP2 shards, deduplication of
replicated tensors, resharding on load); ckptd stores the bytes. Each rank's
write items become ONE ckptd rank shard of the step (rank and world size:
the rank's place in DCP's process group), which the daemon compresses,
drains and commits atomically once every rank has saved.

In a rank's shard:

- a tensor write item is a shard tensor ``<group>:<fqn>`` (or
  ``<group>:<fqn>@<offsets>`` when the rank holds several pieces of it),
  the group taken from the state dict's top-level key ("model";
  "optim"/"optimizer" -> "optimizer"; anything else "extra", whole FQN);
- a non-tensor item, which DCP serializes with torch.save, is a uint8
  tensor ``dcp.bytes:<fqn>``;
- ``ckptd.sharding`` describes the tensor pieces (group, fqn, global shape,
  offsets), so ``ckptd export`` can consolidate the step without torch;
- rank 0's save (DCP's coordinator) carries DCP's global Metadata, pickled
  as DCP's FileSystemWriter pickles it, as the save's metadata (or, when
  larger than a request to the daemon takes, 8 MiB, as a uint8 tensor
  ``dcp.metadata`` of its shard, which older versions always wrote). Its
  storage_data maps every MetadataIndex to ``(rank, tensor name)``, and
  INLINE to ``(-1, {MetadataIndex: bytes})``: the stored bytes of small
  items (a step count, a learning rate), which a load then takes from the
  metadata instead of a restore of another rank's shard.

Where the metadata is written. DCP knows the global Metadata only on the
coordinator, after planning, and a rank's shard is one save. So rank 0
copies its items into a leased region of the arena as soon as it has
them, and commits that region with the metadata in finish(); the other
ranks save theirs at once:

- ``dcp.save``: every rank copies its items in write_data (rank 0 holds
  its region uncommitted), rank 0 commits in finish() and waits for the
  step to commit. DCP returns from save on every rank only after finish:
  **dcp.save returning means the step is durable and committed.**
- ``dcp.async_save``: the Writer is DCP's AsyncStager, and stage() -- run in
  the trainer's thread -- makes this rank's local plan (DCP's
  DefaultSavePlanner) and copies its items straight into the daemon's
  shared-memory arena (one copy), with **no collective**, and returns the
  state dict's dicts and lists copied (DCP's background save plans over
  them, so the trainer may change its own at once): of a DTensor piece
  replicated over a mesh dimension, only the rank at coordinate 0 of it
  stores it; plain (non-DTensor) values, which DCP takes to be replicated,
  are stored by every rank (the metadata names the lowest rank's copy,
  ckptd.sharding describes rank 0's). When stage() returns the trainer
  may change its tensors. The background save DCP then runs plans (shapes
  and collectives), write_data returns what stage() stored, and finish()
  maps DCP's metadata to the stored copies (raising, and saving nothing
  of rank 0, when a planned item was not stored), commits rank 0's region
  with it and waits for the step: **the future async_save returns
  completes only once the step is committed.**

A daemon that is away (not up yet, restarting) is waited for on every
rank, rank 0 too, as Client.save waits: for the client's reconnect_timeout
(_save.Held). A rank 0 lease lost between its copy and its commit (the
daemon restarted, or the connection holding it ended) is made again:
dcp.save from the state itself (its caller still waits), async_save from
the region's bytes when nothing can have written over them (the daemon
that leased it still serves and sees this process, or its arena file went
with it), else the save fails with CkptdError saying so: a daemon that
crashed with saves journaled reuses its arena and may hand the region on.

The trainer's stall in async_save is therefore the local plan and the copy
into shared memory (the first save of a run without an attempt also
broadcasts one, as ckptd.torch does). Staging plans with DCP's default
planner: a custom planner passed to async_save is not used for what is
stored (finish raises if its plan has an item stage() did not store).
A background save that fails before finish leaves rank 0's region leased
until its connection closes or the daemon's --lease-timeout.

Reading: every rank reads the metadata from rank 0's save with a restore
of no tensor (nothing of the step's data is read; the ``dcp.metadata``
tensor when it was too large), then, of each shard its reads need, only
what they read: the whole shard when they read all of it, else the
tensors they read whole and, of a tensor they read part of (a resharded
load), the bytes from the first element read to the last. The daemon
reads only the chunks holding those. Up to READERS restores run at once
(each at most a READERS-th of the arena), and items are copied from the
shared-memory region straight into the planner's tensors, releasing each
region after use.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import pickle
import re
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import _storage_utils, state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.distributed.tensor import DTensor
from torch.futures import Future

from . import _limits, _load, _save, _sharding, _tensors
from ._client import Client
from ._errors import AlreadyExistsError, CkptdError, InvalidArgumentError
from ._handle import SaveHandle
from ._load import LoadedState
from .torch import _run_attempt
from .v1 import ckptd_pb2 as pb

__all__ = ["METADATA", "CheckpointId", "Reader", "Writer", "parse_checkpoint_id"]

_LOG = logging.getLogger("ckptd")
_T = TypeVar("_T")
_R = TypeVar("_R")

METADATA = "dcp.metadata"  # rank 0's pickled DCP Metadata, when too large for a save's
BYTES = "dcp.bytes"  # top-level key of the torch.save'd non-tensor items
DCP_VERSION = "1.0.0"  # Metadata.version, as DCP's FileSystemWriter writes it
READERS = 4  # restores a Reader's read_data runs at once
# Small items' bytes ride in the metadata too, so that a load needs no
# restore for them: an item of at most INLINE_ITEM bytes, while the step's
# total stays within INLINE_TOTAL (the lowest ranks' items first).
INLINE_ITEM = 4 << 10
INLINE_TOTAL = 256 << 10
# storage_data's key for them: a (-1, {MetadataIndex: bytes}) pair, which a
# Reader that knows nothing of it never looks up.
INLINE = MetadataIndex("ckptd.inline")
_INLINE_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
     torch.int16, torch.int8, torch.uint8, torch.bool)
)  # fmt: skip
STREAMED_BATCH = 256 << 20  # the most one such restore brings, streamed (no arena)

# storage_data of the stored Metadata: MetadataIndex -> (rank, tensor name),
# plain tuples so the pickle names no ckptd class.
Where = tuple[int, str]


SCHEME = "ckptd://"
ID_FORMS = (
    "ckptd://<job>/<step> or ckptd:///<step> (the daemon's job), or a path whose last "
    "component names the step: 1000, step-1000, step_1000, checkpoint-1000, ckpt-1000, "
    "iter_0001000, global_step1000, epoch=3-step=1000.ckpt"
)
_NAMED = re.compile(r"(?:step|checkpoint|ckpt|iter|iteration|global_step)[-_]?([0-9]+)")
_KEYED = re.compile(r"(?:.*[-_])?step=([0-9]+)(?:[-_].*)?")  # Lightning's epoch=3-step=1000
_EXTENSION = re.compile(r"\.(?:ckpt|pt|pth|distcp)$")


@dataclasses.dataclass(frozen=True)
class CheckpointId:
    """What a DCP checkpoint_id names: a step and, for ``ckptd://``, maybe a job.

    job None: the id names none (the Writer's or Reader's job, else the
    daemon's). step "latest": only a Reader's ``ckptd://<job>/latest``.
    """

    job: str | None
    step: int | Literal["latest"]


def parse_checkpoint_id(
    checkpoint_id: str | os.PathLike[str], *, latest: bool = False
) -> CheckpointId:
    """The job and step a DCP checkpoint_id names (see ID_FORMS).

    ``ckptd://<job>/<step>`` and ``ckptd:///<step>`` name the step as a
    number or as a path component would (``step-3``); any other id is a
    path (a folder a framework would write into) whose last component
    names the step. A path never names the job: frameworks' folders are
    often called "checkpoints" whatever the run. latest allows
    ``ckptd://<job>/latest`` (a Reader's).

    Raises:
        InvalidArgumentError: the id names no step (or is malformed),
            saying which forms are accepted.
    """
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        raise TypeError(f"checkpoint_id must be a str or a path, not {type(text).__name__}")
    if text.startswith(SCHEME):
        parts = text[len(SCHEME) :].rstrip("/").split("/")
        if len(parts) == 2 and parts[1]:
            job = parts[0] or None
            if latest and parts[1] == "latest":
                return CheckpointId(job, "latest")
            step = _step_of(parts[1])
            if step is not None:
                return CheckpointId(job, step)
        more = ", or ckptd://<job>/latest" if latest else ""
        raise InvalidArgumentError(
            f"checkpoint_id {text!r} names no step; ckptd.dcp takes {ID_FORMS}{more}"
        )
    last = text.rstrip("/").rsplit("/", 1)[-1]
    step = _step_of(last)
    if step is None:
        raise InvalidArgumentError(
            f"checkpoint_id {text!r} names no step (its last component is {last!r}); "
            f"ckptd.dcp takes {ID_FORMS}, or give the step: Writer(client, step=N)"
        )
    return CheckpointId(None, step)


def _step_of(component: str) -> int | None:
    """The step a path component names, or None."""
    name = _EXTENSION.sub("", component)
    if re.fullmatch(r"[0-9]+", name):
        return int(name)
    m = _NAMED.fullmatch(name) or (_KEYED.fullmatch(name) if name.count("step=") == 1 else None)
    return int(m.group(1)) if m else None


def _async_save_call() -> Mapping[str, Any] | None:
    """The arguments of DCP's async_save when it is what is running stage(), else None.

    async_save stages before it gives the writer its checkpoint_id (reset,
    in the background save), and before it chooses its executor: the
    Writer reads both from the call, so that it neither stages a step the
    id contradicts nor stages for a checkpoint process it cannot go to.
    """
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        if (
            f.f_code.co_name == "async_save"
            and f.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_saver"
        ):
            return f.f_locals
        f = f.f_back
    return None


def _cache_default_plans() -> None:
    """Turn DCP's plan caching on for the dcp.save running this, if it plans with DCP's default.

    Called from set_up_storage_writer, after DCP set its planner up and
    before the planner makes its local plan. Only a planner DCP made itself
    (save() was given none) is changed: a planner the caller passed is
    theirs. The cache is keyed by the process group, as DCP's coordinator
    keeps every rank's plan of the group: DCP's own key (the planner's
    class name) would mix two groups' plans in a process that saves over
    both.
    """
    f: types.FrameType | None = sys._getframe(1)
    while f is not None and not (
        f.f_code.co_name == "_save_state_dict"
        and f.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_saver"
    ):
        f = f.f_back
    if f is None or f.f_back is None or f.f_back.f_code.co_name != "save":
        return
    if f.f_back.f_locals.get("planner") is not None:
        return  # the caller's own planner
    planner = f.f_locals.get("planner")
    if type(planner) is not DefaultSavePlanner or planner._enable_plan_caching:
        return
    distw = f.f_locals.get("distW")
    group = getattr(distw, "group", None)
    if group is None and getattr(distw, "use_dist", False):
        group = dist.group.WORLD
    name = getattr(group, "group_name", None) if group is not None else "no-dist"
    planner._enable_plan_caching = True
    planner._cached_plans_key = f"ckptd.dcp:{name}"


def _containers_copied(obj: Any) -> Any:
    """Return obj with the dicts and lists DCP traverses copied, every other value shared."""
    if isinstance(obj, Mapping):
        return {k: _containers_copied(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_containers_copied(v) for v in obj]
    return obj


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    """What prepare_global_plan tells each rank: its place in the step."""

    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one write item goes in its rank's shard."""

    path: tuple[str, str]  # the two dict keys: {path[0]: {path[1]: data}}
    name: str  # the stored tensor name
    piece: _sharding.Piece | None  # None for a bytes item


@dataclasses.dataclass
class _Staged:
    """What stage() saved: its step, the save (rank 0: held until finish), its write results."""

    step: int
    save: SaveHandle | _Held | _Kept
    results: list[WriteResult]


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A save skipped because its step is committed already (Writer(if_committed="keep"))."""

    what: str  # names the save in the log


class _Held:
    """Rank 0's shard: copied into a leased region now, committed in finish() with the metadata.

    The copy is the trainer's stall; the commit, carrying DCP's pickled
    Metadata as the save's metadata, waits for the global plan. Both ride
    out a daemon that is away or restarts, as Client.save does, within the
    client's reconnect_timeout (_save.Held): a lease lost before the commit
    is made again from the state's tensors when they cannot have changed
    (live: dcp.save, whose caller waits), else from the region's bytes when
    nothing can have overwritten them. Metadata larger than one request
    (MAX_METADATA) goes in a ``dcp.metadata`` tensor instead: the shard is
    saved again with it, in the background.
    """

    def __init__(
        self, writer: Writer, tree: dict[str, Any], info: _RankPlan, attempt: str | None, *,
        live: bool,
    ) -> None:  # fmt: skip
        client = writer._client
        own = attempt is None
        resolved = client._attempt if attempt is None else attempt
        step = writer._step_now()
        target = _save.target(writer._job_now(), step, info.rank, info.world_size, resolved)
        if own and client._attempt_random and info.world_size > 1:
            client._warn_random_attempt(info.world_size)
        self._held = _save.Held(client._conn, target, tree)
        self._live = live

    def commit(self, metadata: Metadata) -> SaveHandle:
        """Save the shard with the metadata; return its handle."""
        held = self._held
        again = (lambda: held.shard.leaves) if self._live else held.staged_leaves
        blob = pickle.dumps(metadata)
        if len(blob) <= _limits.MAX_METADATA:
            return held.commit(blob, again)
        extra = _tensors.make_leaf(METADATA, np.frombuffer(blob, dtype=np.uint8))
        return held.commit(b"", again, [extra])

    def abort(self) -> None:
        """Give the region back (the save failed)."""
        self._held.abort()


class Writer(StorageWriter, AsyncStager):
    """A DCP StorageWriter (and AsyncStager) saving steps through ckptd.

    Args:
        client: a connected ckptd.Client.
        step: the step this checkpoint is (then one Writer per step), or
            None: each save's step is the one its checkpoint_id names (see
            parse_checkpoint_id: ``ckptd://<job>/<step>``, or a path such as
            ``.../step-1000``), and the Writer may serve several saves. A
            step given both ways must agree; an id that names none is an
            error, and so is a save with no step at all.
        job: the job (None: the one a ``ckptd://`` id names, else the
            daemon's). An id naming another job is an error.
        attempt: the attempt every rank's save carries. Default: the
            client's when it was given one (Client(attempt=...) or
            $CKPTD_ATTEMPT), else the run's: rank 0 makes one and broadcasts
            it over the default group, once per process group, as
            ckptd.torch does. With a process_group smaller than the default
            group, give one.
        timeout: seconds finish() waits for the step to commit (None: no
            limit).
        process_group: the group async_save is given (stage() plans over
            it); None: the default group. dcp.save uses the group it is given.
        if_committed: what a save of a step that is committed already does
            (DCP's FileSystemWriter overwrites its folder; a committed ckptd
            step is never changed): "error" (default) raises
            AlreadyExistsError, before anything is stored, saying so;
            "keep" keeps the committed step, stores nothing and returns
            (dcp.save, async_save's future) as if saved, logging a warning.
        cache_plans: turn DCP's plan caching on for saves that pass no
            planner (DCP's DefaultSavePlanner): a save of the same state
            layout as the one before sends empty plans to the coordinator,
            which reuses its global plan and metadata (see the module).

    The rank and world size of each shard are the rank's place in DCP's
    process group and that group's size.
    """

    _synchronize_after_execute: bool = False  # stage() is done when it returns

    def __init__(
        self,
        client: Client,
        step: int | None = None,
        *,
        job: str | None = None,
        attempt: str | None = None,
        timeout: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        if_committed: Literal["error", "keep"] = "error",
        cache_plans: bool = True,
    ) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a ckptd.Client, not {type(client).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None, not {type(step).__name__}")
        if if_committed not in ("error", "keep"):
            raise InvalidArgumentError(
                f'if_committed must be "error" or "keep", not {if_committed!r}'
            )
        self._if_committed = if_committed
        self._cache_plans = cache_plans
        self._client = client
        self._step = step
        self._job = job
        self._id: CheckpointId | None = None  # what the current save's checkpoint_id names
        self._id_fresh = False  # _id was given for the save being set up (not a past one's)
        self.checkpoint_id: str | os.PathLike[str] | None = None  # DCP logs it
        self._attempt = attempt
        self._timeout = timeout
        self._group = process_group
        self._lock = threading.Lock()
        self._is_coordinator = False
        self._staged: _Staged | None = None
        # Rank 0's shard during dcp.save, copied in write_data, committed in finish().
        self._pending: _Held | _Kept | None = None

    def __reduce__(self) -> Any:
        raise TypeError(_NO_PROCESS)

    # ---- which step ----------------------------------------------------

    def _use_id(self, checkpoint_id: str | os.PathLike[str]) -> CheckpointId:
        """Check what checkpoint_id names against the Writer's own step and job."""
        named = parse_checkpoint_id(checkpoint_id)
        if self._step is not None and named.step != self._step:
            raise InvalidArgumentError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} names step {named.step}, but this "
                f"ckptd.dcp.Writer saves step {self._step}: give the step one way (Writer(client) "
                f"takes it from the id: {ID_FORMS})"
            )
        if self._job is not None and named.job is not None and named.job != self._job:
            raise InvalidArgumentError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} names job {named.job!r}, but this "
                f"ckptd.dcp.Writer saves job {self._job!r}: give the job one way"
            )
        return named

    def _step_now(self) -> int:
        """The step the current save is."""
        if self._step is not None:
            return self._step
        if self._id is None:
            raise InvalidArgumentError(
                "this ckptd.dcp.Writer has no step: give it one (Writer(client, step=N)) or "
                f"a checkpoint_id that names one: {ID_FORMS}"
            )
        assert isinstance(self._id.step, int)
        return self._id.step

    def _job_now(self) -> str | None:
        if self._job is not None:
            return self._job
        return self._id.job if self._id is not None else None

    # ---- StorageWriter --------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a save of the step checkpoint_id names (if any; see the class).

        What stage() saved is kept (DCP resets after staging): its step must
        be the one the id names.

        Raises:
            InvalidArgumentError: the id names no step, or another step or
                job than the Writer's (or than stage() saved); nothing is
                saved.
        """
        if checkpoint_id is not None:
            named = self._use_id(checkpoint_id)
            staged = self._staged
            if staged is not None and named.step != staged.step:
                raise InvalidArgumentError(
                    f"checkpoint_id {os.fspath(checkpoint_id)!r} names step {named.step}, but "
                    f"this ckptd.dcp.Writer staged step {staged.step} for it"
                )
            self._id, self.checkpoint_id, self._id_fresh = named, checkpoint_id, True
        if isinstance(self._pending, _Held):
            self._pending.abort()
        self._pending = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether checkpoint_id is a ``ckptd://`` id (malformed ones raise in reset)."""
        try:
            return os.fspath(checkpoint_id).startswith(SCHEME)
        except TypeError:
            return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Note the role; refuse DCP's save without collectives.

        A checkpoint_id of an earlier save is forgotten: a save without one
        (and without Writer(step=...)) has no step.
        """
        if not self._id_fresh:
            self._id = None
        self._id_fresh = False
        if self._staged is None:
            self._step_now()  # no step: say so before DCP plans
        if kwargs.get("use_collectives", True) is False:
            raise CkptdError(
                "ckptd.dcp.Writer needs use_collectives=True: a step is one shard per rank "
                "of the process group, with DCP's global metadata in rank 0's"
            )
        self._is_coordinator = is_coordinator
        if self._cache_plans:
            _cache_default_plans()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add to the local plan."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Tell each rank its rank and the world size (the coordinator's view)."""
        n = len(plans)
        return [dataclasses.replace(p, storage_data=_RankPlan(i, n)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's shard (rank 0: copy it, commit in finish()); see the module.

        After stage(), return what it saved instead.
        """
        staged = self._staged
        if staged is not None:
            if not self._is_coordinator:
                self._staged = None  # its save is made: the Writer may take the next one
            return _done(staged.results)
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise CkptdError(
                "ckptd.dcp.Writer.write_data got a plan its prepare_global_plan did not make"
            )
        attempt = self._resolve_attempt(info.world_size)
        tree, results = _shard(plan.items, _layout(plan), planner, info.rank)
        if self._is_coordinator:
            self._pending = self._unless_committed(
                info, lambda: _Held(self, tree, info, attempt, live=True)
            )
        else:
            self._unless_committed(info, lambda: self._save(tree, info, attempt))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: commit its shard with the metadata; wait for the step to commit."""
        held: SaveHandle | _Held | _Kept | None
        if self._staged is not None:
            held, self._staged = self._staged.save, None
        else:
            held, self._pending = self._pending, None
        try:
            if held is None:
                raise CkptdError("ckptd.dcp.Writer.finish before write_data on the coordinator")
            _complete_metadata(metadata, _where(metadata, results))
            if isinstance(held, _Kept):
                return
            handle = held.commit(metadata) if isinstance(held, _Held) else held
        except BaseException:
            if isinstance(held, _Held):
                held.abort()
            raise
        handle.wait(self._timeout)

    # ---- AsyncStager ----------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy this rank's items into the daemon's arena; no collective (see the module).

        Returns state_dict's containers copied (its leaves as they are):
        once stage() returns, the bytes are in shared memory and the trainer
        may change its tensors, and its dicts and lists too; DCP's
        background save only plans over the copy (names and shapes) and
        commits.
        """
        call = _async_save_call()
        if call is not None:
            kind = call.get("async_checkpointer_type")
            if getattr(kind, "name", None) == "PROCESS":
                raise CkptdError(_NO_PROCESS)
            cid = call.get("checkpoint_id")
            self._id = None if cid is None else self._use_id(cid)
            self.checkpoint_id, self._id_fresh = cid, True
        with self._lock:
            if self._staged is not None:
                raise CkptdError(
                    f"this ckptd.dcp.Writer already staged step {self._staged.step}, whose "
                    "save has not finished: wait for one async_save before the next"
                )
            step = self._step_now()
            use_dist = dist.is_available() and dist.is_initialized()
            distw = _DistWrapper(self._group, use_dist, 0)
            info = _RankPlan(distw.get_rank(), distw.get_world_size())
            attempt = self._resolve_attempt(info.world_size)
            planner = DefaultSavePlanner()
            planner.set_up_planner(state_dict, is_coordinator=distw.is_coordinator)
            plan = _own_items(planner.create_local_plan(), planner.state_dict)
            plain = {
                item.index
                for item in plan.items
                if not isinstance(planner.state_dict.get(item.index.fqn), DTensor)
            }
            # Plain values are taken to be replicated: every rank stores its
            # own (the metadata names the lowest rank's); rank 0 describes them.
            tree, results = _shard(
                plan.items,
                _layout(plan),
                planner,
                info.rank,
                skip=set() if info.rank == 0 else plain,
            )
            save: SaveHandle | _Held | _Kept
            if distw.is_coordinator:
                save = self._unless_committed(
                    info, lambda: _Held(self, tree, info, attempt, live=False)
                )
            else:
                save = self._unless_committed(info, lambda: self._save(tree, info, attempt))
            self._staged = _Staged(step, save, results)
        copied: dict[str, Any] = _containers_copied(state_dict)
        return copied

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() has copied when it returns."""

    def close(self) -> None:
        """Nothing to release."""

    # ---- helpers --------------------------------------------------------

    def _unless_committed(self, info: _RankPlan, save: Callable[[], _T]) -> _T | _Kept:
        """save(), or, when the step is committed already, what if_committed says.

        Raises:
            AlreadyExistsError: the step is committed (if_committed="error"),
                saying how to keep it instead.
        """
        try:
            return save()
        except AlreadyExistsError as e:
            if e.reason != "STEP_COMMITTED":
                raise
            what = f"step {self._step_now()} rank {info.rank}"
            if self._if_committed == "keep":
                _LOG.warning(
                    "ckptd.dcp: %s not saved: the step is committed already, and "
                    'if_committed="keep" keeps it as it is',
                    what,
                )
                return _Kept(what)
            raise AlreadyExistsError(
                f"{e}. ckptd never changes a committed step (DCP's FileSystemWriter would "
                "overwrite its folder): save the state as another step, or pass "
                'ckptd.dcp.Writer(..., if_committed="keep") to keep the committed step '
                "and skip such a save",
                code=e.code,
                details=e.details,
                reason=e.reason,
                metadata=e.metadata,
            ) from None

    def _resolve_attempt(self, world_size: int) -> str | None:
        """The attempt to save under; None: the client's own. Maybe a collective."""
        if self._attempt is not None:
            return self._attempt
        if self._client._attempt_random:
            return _run_attempt(world_size)
        return None

    def _save(self, tree: dict[str, Any], info: _RankPlan, attempt: str | None) -> SaveHandle:
        return self._client.save(
            self._step_now(),
            tree,
            rank=info.rank,
            world_size=info.world_size,
            job=self._job_now(),
            attempt=attempt,
        )


_NO_PROCESS = (
    "a ckptd.dcp.Writer cannot go to DCP's checkpoint process "
    "(async_checkpointer_type=AsyncCheckpointerType.PROCESS): its client holds a connection "
    "to the daemon, which owns rank 0's staged region. Use the default "
    "AsyncCheckpointerType.THREAD: stage() already copies the state into the daemon's shared "
    "memory, and the daemon compresses and writes it in the background, so the thread only "
    "plans and commits"
)


class Reader(StorageReader):
    """A DCP StorageReader loading a step that ckptd.dcp.Writer saved.

    Args:
        client: a connected ckptd.Client.
        step: the step, or "latest" for the newest committed one (resolved
            once, when DCP reads the metadata: every shard then comes from
            that step), or None: each load's step is the one its
            checkpoint_id names (as for Writer; ``ckptd://<job>/latest``
            too). A step given both ways must agree.
        job: the job (None: the one a ``ckptd://`` id names, else the
            daemon's).

    Loading reshards freely: the process group may have another size than
    the one that saved. Each rank restores what its reads need of each
    shard (see the module), copies it into the state dict's tensors, and
    keeps nothing after dcp.load.
    """

    def __init__(
        self,
        client: Client,
        step: int | Literal["latest"] | None = None,
        *,
        job: str | None = None,
    ) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a ckptd.Client, not {type(client).__name__}")
        if (
            step is not None
            and step != "latest"
            and (isinstance(step, bool) or not isinstance(step, int))
        ):
            raise TypeError(f'step must be an int, "latest" or None, not {step!r}')
        self._client = client
        self._given: int | Literal["latest"] | None = step
        self._job_given = job
        self._id: CheckpointId | None = None
        self._id_fresh = False
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self._resolved: int | None = None
        self._where: dict[MetadataIndex, Where] = {}
        self._layout = _Layout()
        self._extra_in_0 = False  # rank 0's shard also holds the dcp.metadata tensor
        self._inline: dict[MetadataIndex, bytes] = {}  # small items' bytes (INLINE)
        self._metadata: Metadata | None = None

    @property
    def _step(self) -> int | Literal["latest"]:
        if self._given is not None:
            return self._given
        if self._id is None:
            raise InvalidArgumentError(
                "this ckptd.dcp.Reader has no step: give it one (Reader(client, step=N) or "
                f'"latest") or a checkpoint_id that names one: {ID_FORMS}, or '
                "ckptd://<job>/latest"
            )
        return self._id.step

    @property
    def _job(self) -> str | None:
        if self._job_given is not None:
            return self._job_given
        return self._id.job if self._id is not None else None

    @property
    def step(self) -> int | None:
        """The step being read (once the metadata is read; "latest" resolved)."""
        return self._resolved

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a load (of the step checkpoint_id names, if any): forget a resolved "latest".

        Raises:
            InvalidArgumentError: the id names no step, or another step or
                job than the Reader's.
        """
        if checkpoint_id is not None:
            named = parse_checkpoint_id(checkpoint_id, latest=True)
            text = os.fspath(checkpoint_id)
            if self._given is not None and named.step != self._given:
                raise InvalidArgumentError(
                    f"checkpoint_id {text!r} names step {named.step}, but this ckptd.dcp.Reader "
                    f"reads step {self._given}: give the step one way (Reader(client) takes it "
                    f"from the id: {ID_FORMS})"
                )
            if self._job_given is not None and named.job not in (None, self._job_given):
                raise InvalidArgumentError(
                    f"checkpoint_id {text!r} names job {named.job!r}, but this "
                    f"ckptd.dcp.Reader reads job {self._job_given!r}: give the job one way"
                )
            self._id, self.checkpoint_id, self._id_fresh = named, checkpoint_id, True
        self._resolved = None
        self._where = {}
        self._layout = _Layout()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether checkpoint_id is a ``ckptd://`` id (malformed ones raise in reset)."""
        return Writer.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Unpickle DCP's Metadata from rank 0's save of the step.

        It is the save's metadata, which a restore of no tensor brings (no
        data of the step is read), or, when it was too large for that, the
        shard's ``dcp.metadata`` tensor (the daemon reads only that
        tensor's chunks).

        Raises:
            NotFoundError: no such committed step (or, for "latest", none).
            CkptdError: the step was not saved by ckptd.dcp.Writer.
        """
        if not self._id_fresh:
            self._id = None  # an earlier load's id: this one gave none
        self._id_fresh = False
        req = _load.restore_request(self._step, 0, self._job, header_only=True)
        header, _ = _load.restore(
            self._client._conn, req, "load the DCP metadata", lambda h, d, a: None
        )
        step, blob = header.step, header.metadata
        self._extra_in_0 = not blob
        if not blob:
            try:
                shard = self._load(step, 0, [METADATA])
            except InvalidArgumentError as e:  # the daemon names the tensor it lacks
                raise CkptdError(
                    f"step {step} was not saved by ckptd.dcp.Writer: rank 0's shard has no "
                    f"metadata and no {METADATA!r} tensor (load it with ckptd.torch or "
                    f"Client.load): {e}"
                ) from None
            blob = shard.pop(METADATA).numpy().tobytes()
        # As DCP's own FileSystemReader: the metadata is a pickle. Load only
        # checkpoints you trust.
        try:
            md = pickle.loads(blob)
        except Exception:  # another client's metadata, whatever it is
            md = None
        if not isinstance(md, Metadata):
            raise CkptdError(
                f"step {step} was not saved by ckptd.dcp.Writer: rank 0's save holds no "
                "DCP Metadata (load it with ckptd.torch or Client.load)"
            )
        self._resolved = step
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the MetadataIndex -> (rank, tensor name) map from the metadata."""
        where = metadata.storage_data
        if not isinstance(where, Mapping) or not all(
            isinstance(w, tuple) and len(w) == 2 for w in where.values()
        ):
            raise CkptdError(
                "the checkpoint's DCP metadata does not map items to ckptd rank shards"
            )
        self._where = dict(where)
        _, inline = self._where.pop(INLINE, (-1, {}))
        self._inline = inline if isinstance(inline, dict) else {}
        self._metadata = metadata
        self._layout = _Layout.of(metadata, self._where, self._extra_in_0, set(self._inline))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each read item out of its rank shard, straight into its destination.

        Of each rank shard, restores bring what this rank's items need and
        nothing else: the tensors they read whole (the whole shard when
        that is all of it), and of a tensor they read part of (a resharded
        load), the bytes from the first element they read to the last; the
        daemon reads only the chunks holding them. Items are copied from
        the shared-memory region into the planner's tensors, with no copy
        in between. Up to READERS restores run at once, each of at most a
        READERS-th of the arena, so that the daemon fills one region
        while this process copies out of another.
        """
        by_rank: dict[int, list[tuple[ReadItem, str]]] = {}
        for req in plan.items:
            blob = self._inline.get(req.storage_index)
            if blob is not None:
                self._read_inline(req, blob, planner)
                continue
            where = self._where.get(req.storage_index)
            if where is None:
                raise CkptdError(
                    f"the checkpoint's metadata places no {req.storage_index.fqn!r} at "
                    f"{req.storage_index.offset}"
                )
            by_rank.setdefault(where[0], []).append((req, where[1]))
        step = self._resolved if self._resolved is not None else self._step
        limit = self._batch_limit()
        jobs = [
            j for rank in sorted(by_rank) for j in self._layout.jobs(rank, by_rank[rank], limit)
        ]
        lock = threading.Lock()
        if len(jobs) <= 1:
            for job in jobs:
                self._read_into(step, job, planner, lock)
            return _done(None)
        with ThreadPoolExecutor(min(len(jobs), READERS), thread_name_prefix="ckptd.dcp") as pool:
            futures = [pool.submit(self._read_into, step, job, planner, lock) for job in jobs]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return _done(None)

    def _read_inline(self, req: ReadItem, blob: bytes, planner: LoadPlanner) -> None:
        """Load an item whose bytes the metadata holds (see INLINE)."""
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(blob))
            return
        idx = req.storage_index
        item = self._metadata.state_dict_metadata.get(idx.fqn) if self._metadata else None
        chunk = None
        if isinstance(item, TensorStorageMetadata):
            chunk = next((c for c in item.chunks if c.offsets == idx.offset), None)
        if chunk is None or not isinstance(item, TensorStorageMetadata):
            raise CkptdError(f"the checkpoint's metadata describes no {idx.fqn!r} at {idx.offset}")
        td, shape = item.properties.dtype, tuple(int(d) for d in chunk.sizes)
        if len(blob) != td.itemsize * _numel(shape):
            raise CkptdError(f"{idx.fqn!r}: the metadata holds {len(blob)} bytes of it")
        flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(td) if blob else None
        _copy_into(planner, req, _block_of(flat, td, shape, 0, req, idx.fqn))

    def _batch_limit(self) -> int:
        """The most tensor bytes one restore of read_data asks for.

        READERS restores of this size fit the daemon's arena at once (as
        the metadata's restore mapped it); a client that streams holds them
        in its own memory.
        """
        arena = self._client._conn.arena
        if arena is None:
            return STREAMED_BATCH
        return max(1, arena.size // READERS)

    def _read_into(
        self, step: int | Literal["latest"], job: _Job, planner: LoadPlanner, lock: threading.Lock
    ) -> None:
        """Make job's restore and copy its items out of it.

        The planner learns of each item (commit_tensor, load_bytes) once the
        copies are known good: the region stayed this restore's throughout.
        """
        req = _load.restore_request(
            step,
            job.rank,
            self._job,
            job.names,
            slices=[(n, lo, hi - lo) for n, lo, hi in job.slices],
        )
        what = f"load step {step} rank {job.rank} for DCP"
        _, (copied, blobs) = _load.restore(
            self._client._conn,
            req,
            what,
            lambda header, data, _arena: _copy_out(header, data, job, planner, lock),
        )
        with lock:
            for r, dst in copied:
                planner.commit_tensor(r, dst)
            for r, blob in blobs:
                planner.load_bytes(r, io.BytesIO(blob))

    def _load(self, step: int | Literal["latest"], rank: int, names: Sequence[str]) -> LoadedState:
        return self._client.load(
            step, rank=rank, job=self._job, as_torch=True, nested=False, tensors=names
        )


@dataclasses.dataclass(frozen=True)
class _Job:
    """One restore of read_data: of rank's shard, names (None: all of it) or slices.

    slices: (tensor, first byte, end byte) each; items: the read items it
    serves, with the stored tensor each reads.
    """

    rank: int
    names: list[str] | None
    slices: list[tuple[str, int, int]]
    items: list[tuple[ReadItem, str]]

    def start(self, name: str) -> int:
        """The byte of the tensor name that the restored bytes of it begin with."""
        return next((lo for n, lo, _ in self.slices if n == name), 0)


@dataclasses.dataclass
class _Layout:
    """What the metadata says of the stored tensors a Reader may restore.

    sizes: bytes of each stored tensor (bytes items: 0, unknown and small);
    shapes and itemsizes: each stored tensor's (tensor items only);
    order: each rank's tensors in the order the metadata lists them (the
    order they were saved in, near enough), less the small ones the
    metadata holds; whole: each rank's shard's tensors, when restoring all
    of it restores nothing else of size (rank 0's shard with a dcp.metadata
    tensor is never whole).
    """

    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    itemsizes: dict[str, int] = dataclasses.field(default_factory=dict)
    order: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    whole: dict[int, set[str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        md: Metadata,
        where: Mapping[MetadataIndex, Where],
        extra_in_0: bool,
        inline: Set[MetadataIndex],
    ) -> _Layout:
        lay = cls()
        for idx, (rank, name) in where.items():
            if idx in inline:
                continue  # read from the metadata: a whole restore brings it too, small
            item = md.state_dict_metadata.get(idx.fqn)
            if isinstance(item, TensorStorageMetadata):
                chunk = next((c for c in item.chunks if c.offsets == idx.offset), None)
                if chunk is not None:
                    shape = tuple(int(d) for d in chunk.sizes)
                    itemsize = item.properties.dtype.itemsize
                    lay.shapes[name], lay.itemsizes[name] = shape, itemsize
                    lay.sizes[name] = itemsize * _numel(shape)
            lay.sizes.setdefault(name, 0)
            order = lay.order.setdefault(rank, {})
            order.setdefault(name, len(order))
        lay.whole = {r: set(o) for r, o in lay.order.items() if not (r == 0 and extra_in_0)}
        return lay

    def jobs(self, rank: int, reqs: list[tuple[ReadItem, str]], limit: int) -> list[_Job]:
        """The restores of rank's shard that reqs need, each of at most limit bytes.

        A tensor that the items read part of is restored from the first
        byte they read to the last (a slice); the others whole. Names are
        kept in the shard's order and cut into runs of at most limit bytes
        (one tensor larger than that is a run alone), so that each restore
        reads adjacent chunks.
        """
        spans: dict[str, tuple[int, int] | None] = {}  # None: all of it
        for req, name in reqs:
            span = self._span(req, name)
            if name in spans:
                have = spans[name]
                span = (
                    None
                    if have is None or span is None
                    else (min(have[0], span[0]), max(have[1], span[1]))
                )
            spans[name] = span
        order = self.order.get(rank, {})
        names = sorted(spans, key=lambda n: order.get(n, -1))
        whole = [n for n in names if spans[n] is None]
        part = [(n, *span) for n in names if (span := spans[n]) is not None]
        total = sum(self.sizes[n] for n in whole)
        if not part and total <= limit and self.whole.get(rank) == set(whole):
            return [_Job(rank, None, [], reqs)]
        jobs = [_Job(rank, run, [], []) for run in _runs(whole, self.sizes.__getitem__, limit)]
        jobs += [_Job(rank, None, run, []) for run in _runs(part, lambda s: s[2] - s[1], limit)]
        of_name = {n: job for job in jobs for n in (job.names or [s[0] for s in job.slices])}
        for req, name in reqs:
            of_name[name].items.append((req, name))
        return jobs

    def _span(self, req: ReadItem, name: str) -> tuple[int, int] | None:
        """The bytes of the stored tensor name that req reads, first to last; None: all."""
        shape = self.shapes.get(name)
        if req.type == LoadItemType.BYTE_IO or shape is None:
            return None
        itemsize = self.itemsizes[name]
        lo, hi = _extent(shape, req.storage_offsets, req.lengths)
        if (lo, hi) == (0, _numel(shape)):
            return None
        return lo * itemsize, hi * itemsize


def _runs(things: Sequence[_R], size: Callable[[_R], int], limit: int) -> list[list[_R]]:
    """Things cut into runs, in order, of at most limit bytes (a larger thing alone)."""
    runs: list[list[_R]] = []
    total = 0
    for thing in things:
        n = size(thing)
        if not runs or (runs[-1] and total + n > limit):
            runs.append([])
            total = 0
        runs[-1].append(thing)
        total += n
    return runs


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of shape."""
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return tuple(out)


def _extent(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int]:
    """The elements of a contiguous tensor of shape from the block's first to past its last."""
    if any(n == 0 for n in lengths):
        return 0, 0
    strides = _strides(shape)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first, last + 1


def _copy_out(
    header: pb.RestoreHeader,
    data: np.ndarray,
    job: _Job,
    planner: LoadPlanner,
    lock: threading.Lock,
) -> tuple[list[tuple[ReadItem, torch.Tensor]], list[tuple[ReadItem, bytes]]]:
    """Copy each item of job from the restored bytes into the planner's tensor for it.

    Returns the tensors copied into and the bytes items' bytes, for the
    planner once the restore is known good.
    """
    table = {t.name: t for t in header.tensors}
    # Whole chunks (checked), or the hot copy in place: the table finds each slice.
    widened = header.HasField("copy_check") or header.in_place
    if job.slices and not widened and header.size != sum(hi - lo for _, lo, hi in job.slices):
        raise CkptdError(
            f"the daemon restored {header.size} bytes for slices of "
            f"{sum(hi - lo for _, lo, hi in job.slices)}: it predates slices (ckptd serve "
            "older than this client)"
        )
    copied: list[tuple[ReadItem, torch.Tensor]] = []
    blobs: list[tuple[ReadItem, bytes]] = []
    for req, name in job.items:
        t = table.get(name)
        if t is None:
            raise CkptdError(f"rank {job.rank}'s shard has no tensor {name!r} the metadata names")
        if t.offset + t.length > data.size:
            raise CkptdError(f"tensor {name!r} lies outside the restored region")
        raw = data[t.offset : t.offset + t.length]
        if req.type == LoadItemType.BYTE_IO:
            blobs.append((req, raw.tobytes()))
            continue
        src = _block(t, raw, job.start(name), req)
        with lock:
            dst = planner.resolve_tensor(req).detach()
        _copy_block(req, dst, src, name)
        copied.append((req, dst))
    return copied, blobs


def _copy_block(req: ReadItem, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy src, the block req reads of stored tensor name, into dst, its destination."""
    if dst.size() != src.size():
        raise CkptdError(
            f"{req.storage_index.fqn!r}: the read needs {tuple(dst.size())} elements, "
            f"the stored piece {name!r} gives {tuple(src.size())}"
        )
    if dst.dtype == src.dtype:  # bit for bit, also dtypes torch cannot copy itself
        _tensors.bits(torch, dst).copy_(_tensors.bits(torch, src))
    else:
        dst.copy_(src)


def _copy_into(planner: LoadPlanner, req: ReadItem, src: torch.Tensor) -> None:
    """Copy src into the planner's tensor for req, and commit it."""
    dst = planner.resolve_tensor(req).detach()
    _copy_block(req, dst, src, req.storage_index.fqn)
    planner.commit_tensor(req, dst)


def _block(t: pb.Tensor, raw: np.ndarray, start: int, req: ReadItem) -> torch.Tensor:
    """The block req reads of stored tensor t, whose bytes from start are raw: a view, no copy.

    Bytes not aligned for the dtype (restored tensors are packed back to
    back) are copied first.
    """
    dt = _tensors.BY_NAME.get(t.dtype)
    if dt is None:
        raise CkptdError(f"tensor {t.name!r} has dtype {t.dtype}, unknown to this client")
    td = _tensors.torch_dtype(torch, dt)
    if raw.size and raw.ctypes.data % td.itemsize:
        raw = raw.copy()  # numpy allocates aligned for every element size
    flat = torch.from_numpy(raw).view(td) if raw.size else None
    return _block_of(flat, td, tuple(int(d) for d in t.shape), start, req, t.name)


def _block_of(
    flat: torch.Tensor | None,
    td: torch.dtype,
    shape: tuple[int, ...],
    start: int,
    req: ReadItem,
    name: str,
) -> torch.Tensor:
    """The block req reads of a stored tensor of shape whose bytes from start are flat."""
    offsets, lengths = tuple(req.storage_offsets), tuple(int(n) for n in req.lengths)
    lo, hi = _extent(shape, offsets, lengths)
    if lo == hi:
        return torch.empty(lengths, dtype=td)
    size = td.itemsize
    have = 0 if flat is None else flat.numel() * size
    if flat is None or start % size or lo * size < start or hi * size > start + have:
        raise CkptdError(
            f"the restored bytes [{start}, +{have}) of {name!r} do not hold elements "
            f"[{lo}, {hi}) that the read needs"
        )
    return flat.as_strided(lengths, _strides(shape), lo - start // size)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _split(fqn: str) -> tuple[str, ...]:
    """A flattened FQN's path when the planner kept no mapping: first key, rest."""
    head, sep, rest = fqn.partition(".")
    return (head, rest) if sep else (head,)


def _layout(plan: SavePlan) -> dict[MetadataIndex, _Slot]:
    """Where each of a rank's write items goes in its shard (deterministic)."""
    paths = plan.planner_data if isinstance(plan.planner_data, Mapping) else {}
    keyed: list[tuple[WriteItem, str, str]] = []
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            keyed.append((item, BYTES, fqn))
        else:
            group, gfqn = _sharding.group_of(paths.get(fqn) or _split(fqn))
            keyed.append((item, group, gfqn))
    several = _sharding.repeated((g, f) for item, g, f in keyed if item.tensor_data is not None)
    out: dict[MetadataIndex, _Slot] = {}
    names: set[str] = set()
    for item, group, fqn in keyed:
        td = item.tensor_data
        if td is None:
            path, piece = _sharding.key_path(group, fqn, None), None
        else:
            offsets = tuple(int(o) for o in td.chunk.offsets)
            path = _sharding.key_path(group, fqn, offsets if (group, fqn) in several else None)
            piece = _sharding.Piece(group, fqn, tuple(int(d) for d in td.size), offsets)
        name = _sharding.stored_name(path)
        if name in names:
            raise ValueError(
                f"two items of the state dict would be stored as {name!r} "
                f"(the last: {item.index.fqn!r}); rename a top-level key"
            )
        names.add(name)
        out[item.index] = _Slot(path, name, piece)
    return out


def _shard(
    items: Sequence[WriteItem],
    slots: Mapping[MetadataIndex, _Slot],
    planner: SavePlanner,
    rank: int,
    skip: Set[MetadataIndex] = frozenset(),
) -> tuple[dict[str, Any], list[WriteResult]]:
    """The nested dict Client.save stores for items, and their write results.

    ckptd.sharding describes every tensor piece but those of skip.
    """
    tree: dict[str, Any] = {}
    pieces: dict[str, _sharding.Piece] = {}
    results = []
    for item in items:
        slot = slots[item.index]
        data = planner.resolve_data(item)
        if isinstance(data, io.BytesIO):
            value: Any = np.frombuffer(data.getbuffer(), dtype=np.uint8).copy()
            nbytes = value.nbytes
        else:
            value = data.detach()
            nbytes = value.numel() * value.element_size()
            if slot.piece is None or tuple(value.shape) != tuple(
                item.tensor_data.chunk.sizes if item.tensor_data else ()
            ):
                raise CkptdError(
                    f"{item.index.fqn!r}: the planner resolved a tensor of shape "
                    f"{tuple(value.shape)} for a piece planned otherwise"
                )
            if item.index not in skip:
                pieces[slot.name] = slot.piece
        tree.setdefault(slot.path[0], {})[slot.path[1]] = value
        stored: tuple[Any, ...] = (rank, slot.name)
        if nbytes <= INLINE_ITEM:
            blob = _small_bytes(value)
            if blob is not None:
                stored = (rank, slot.name, blob)
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=stored))
    tree[_sharding.TENSOR] = _sharding.encode(pieces)
    return tree, results


def _small_bytes(value: Any) -> bytes | None:
    """A small item's stored bytes, for the metadata; None for a dtype kept out of it."""
    if isinstance(value, np.ndarray):
        return value.tobytes()
    if value.dtype not in _INLINE_DTYPES:
        return None
    flat = value.detach().cpu().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else b""


def _own_items(plan: SavePlan, flat: Mapping[str, Any]) -> SavePlan:
    """The plan less the DTensor pieces another rank stores, decided locally.

    A piece replicated over a mesh dimension (any placement but Shard) is
    stored by the rank at coordinate 0 of it, as DCP's deduplication would
    keep one copy; every rank can tell without a collective.
    """
    items = []
    for item in plan.items:
        obj = flat.get(item.index.fqn)
        if isinstance(obj, DTensor):
            coord = obj.device_mesh.get_coordinate() or ()
            if any(c != 0 and not p.is_shard() for c, p in zip(coord, obj.placements, strict=True)):
                continue
        items.append(item)
    return dataclasses.replace(plan, items=items)


def _where(md: Metadata, results: Sequence[Sequence[WriteResult]]) -> dict[MetadataIndex, Any]:
    """The stored place of each item of md: the lowest rank's copy of it; INLINE's too.

    Raises CkptdError when no rank stored one (a planner that plans other
    items than DCP's default one, which stage() uses).
    """
    stored: dict[MetadataIndex, Any] = {}
    for rank_results in results:  # in rank order
        for wr in rank_results:
            stored.setdefault(wr.index, wr.storage_data)
    where: dict[MetadataIndex, Any] = {}
    inline: dict[MetadataIndex, bytes] = {}
    room = INLINE_TOTAL
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            wanted = [MetadataIndex(fqn)]
        else:
            wanted = [MetadataIndex(fqn, c.offsets) for c in item.chunks]
        for idx in wanted:
            if idx not in stored:
                raise CkptdError(
                    f"DCP's plan has {fqn!r} at {idx.offset}, which no rank's "
                    "ckptd.dcp.Writer stored: async_save through ckptd.dcp stages with "
                    "DCP's default planner; pass no other planner"
                )
            rank, name, *blob = stored[idx]
            where[idx] = (rank, name)
            if blob and len(blob[0]) <= room:
                inline[idx] = blob[0]
                room -= len(blob[0])
    if inline:
        where[INLINE] = (-1, inline)
    return where


def _complete_metadata(md: Metadata, where: Mapping[MetadataIndex, Any]) -> Metadata:
    md.version = DCP_VERSION
    md.storage_data = dict(where)
    return md


# ---- a ckptd:// checkpoint_id without a storage --------------------------

_default_lock = threading.Lock()
_default: Client | None = None


def _default_client() -> Client:
    """The process's Client of the node's daemon (default socket), made on first use."""
    global _default  # noqa: PLW0603 - one connection per process, made lazily
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def _finding_ckptd(original: Callable[..., Any]) -> Callable[..., Any]:
    """DCP's _storage_setup, which also gives a ckptd.dcp storage for a ckptd:// id."""

    @functools.wraps(original)
    def _storage_setup(
        storage: StorageReader | StorageWriter | None,
        checkpoint_id: str | os.PathLike[str] | None,
        reader: bool = False,
    ) -> StorageReader | StorageWriter | None:
        if storage or checkpoint_id is None or not Writer.validate_checkpoint_id(checkpoint_id):
            given: StorageReader | StorageWriter | None = original(storage, checkpoint_id, reader)
            return given
        found: Reader | Writer = Reader(_default_client()) if reader else Writer(_default_client())
        found.reset(checkpoint_id)
        return found

    _storage_setup.ckptd = True  # type: ignore[attr-defined]
    return _storage_setup


def _find_ckptd_by_id() -> bool:
    """Let DCP pick ckptd.dcp for a ``ckptd://`` checkpoint_id given without a storage.

    DCP (torch 2.15) has no registry of storages: given only a
    checkpoint_id, its _storage_setup asks its own FileSystem and Fsspec
    writers (readers) in turn, and neither takes ``ckptd://``. Importing
    ckptd.dcp wraps that function where DCP's save and load call it, so a
    ``ckptd://`` id, which no DCP storage takes, gets a Writer (Reader) of
    the node's daemon (Client() at its default socket, one per process);
    every other id goes to DCP as before. False when this torch has no such
    function (DCP then says it "Cannot detect which StorageReader or
    StorageWriter to use": pass one).
    """
    original = getattr(_storage_utils, "_storage_setup", None)
    if original is None:
        return False
    if getattr(original, "ckptd", False):
        return True
    hooked = _finding_ckptd(original)
    found = False
    for module in (_storage_utils, state_dict_saver, state_dict_loader):
        if getattr(module, "_storage_setup", None) is original:
            module._storage_setup = hooked  # type: ignore[attr-defined]
            found = True
    return found


FOUND_BY_ID = _find_ckptd_by_id()
