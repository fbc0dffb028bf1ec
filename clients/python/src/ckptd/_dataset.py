"""Datasets delivered by the daemon's prefetcher through ring slots in the arena.

The protocol (proto/ckptd/v1/ckptd.proto, service Prefetch; the Go client in
clients/go/ckptd/dataset.go): OpenDataset starts a session for one rank's
pass over one epoch; each NextBatch gives back the slots named in
``release`` and returns the next batch -- a lease on a region of the arena
plus, per sample, where each field lies in it; CloseDataset frees the
session's ring. The daemon reads, caches, parses and copies ahead of the
trainer, so a batch is normally waiting when next() asks for it.

A batch's fields live in the arena slot until the next batch is asked for.
With ``copy=True`` (the default) each field is copied out into ``bytes`` --
one memcpy, which costs far less than decoding a sample -- so batches can
be kept, pickled and sent to other processes. With ``copy=False`` fields
are read-only memoryviews into the slot: no copy at all, but each view is
released (any use raises ValueError) when the next batch is requested, so
decode or copy what you keep before then.
"""

from __future__ import annotations

import contextlib
import operator
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc

from . import _limits, _position, _ranks
from ._errors import CkptdError, CorruptShardError, InvalidArgumentError
from .v1 import ckptd_pb2 as pb

if TYPE_CHECKING:
    from ._arena import Arena
    from ._transport import Connection

Sample = dict[str, Any]
"""A sample: ``"__key__"`` (str) and one bytes-like value per extension."""

_CLOSE_TIMEOUT = 5.0  # seconds for a CloseDataset sent on cleanup


@dataclass(frozen=True)
class DatasetSpec:
    """Which dataset to read, and one rank's place in it: what a pass starts from.

    Given to ``Client.dataset(spec)`` and ``ckptd.torch.CkptdIterableDataset(spec)``.
    The sample order is a pure function of (source, format, seed, epoch,
    rank, world_size, shuffle_window, shuffle_block, even): shards are
    shuffled per epoch and dealt round-robin to the ranks, so each sample
    comes exactly once per epoch across all ranks, and samples are shuffled
    within a window (or in blocks of shards);
    ``even`` then gives every rank the same number of samples. ``start``
    counts the samples of that order already consumed, so
    ``Dataset.state()`` (a dict of these fields, JSON-safe) is what to
    checkpoint, and ``client.dataset(DatasetSpec(**state))`` resumes exactly.

    Args:
        source: a folder or path-like (relative paths are made absolute
            here, against this process's cwd, not the daemon's),
            ``file:///path`` or ``s3://bucket/prefix``; or a mixture, as
            Mosaic's streams with proportions and litdata's combined
            datasets with weights: a sequence of ``(source, weight)`` or
            ``(source, weight, format)`` (format "auto" when not given),
            read in one session, each source a share of every epoch's
            shards set by its weight. Every epoch of a source delivers each
            of its samples exactly once, however its weight spreads it over
            the mixture's epochs (a source weighted above its size repeats
            within an epoch, one below spreads over several); a sample's
            key is its source's place in the list, "/", and its key there.
            Resume and elastic resume work as for one source, with the same
            mixture. ``format`` is then not used.
        format: "webdataset" (the default: ``.tar`` shards; a sample is
            the run of members sharing a key, a field per extension),
            "mds" (Mosaic streaming's shards as its MDSWriter wrote them,
            any compression: a field per column, its bytes as MDS encodes
            them, the key the sample's global index), "parquet" (a row
            group a shard, a field per column), "raw" (each object one
            sample, its field named by its extension, "bin" without one),
            or "auto": told from what the source holds (``.tar`` shards
            are webdataset, else a Mosaic ``index.json`` is mds, else
            ``.parquet`` files are parquet).
        batch_size: samples per batch (the last one may be smaller); changing
            it does not change the order.
        rank: this rank, in [0, world_size). Default: this process's --
            torch.distributed's when initialized, else $RANK, else 0 unless
            a launcher is detected (then ValueError).
        world_size: ranks reading the dataset; shards are split among them.
            Default: as rank ($WORLD_SIZE, else 1).
        seed: the shuffling seed, the same on every rank.
        epoch: which epoch: each epoch has its own order.
        start: samples of this epoch this rank already consumed (resume).
        delivered: instead of start, the epoch's samples delivered so far,
            as ``Dataset.state(elastic=True)`` of every rank that read it
            gives them (``ckptd.torch.gather_dataset_state`` gathers them):
            opaque positions, as base64 str (what state() gives) or bytes,
            unioned. The epoch then resumes at any world size: what is left
            is dealt among the new ranks, each sample delivered once (start
            then counts samples of that resumed order). Kept as bytes.
        shuffle_window: samples shuffled together (None: the daemon's
            default, 1000; 1: shard order, no shuffling).
        shuffle_block: instead of the window, shuffle in blocks of this
            many of the rank's shards (0, the default: the window): every
            sample of a block is read, then the block is delivered in a
            random order, so that neighbouring samples come from any of
            its shards, where a window smaller than a shard draws most of
            them from one (Mosaic streaming's block shuffles do the same).
            A block's samples are held at once, within half the daemon's
            --read-ahead-bytes (past it, samples leave early, as from a
            full window). At most 65,536.
        skip_corrupt: skip shards that cannot be parsed, counting them in
            stats().corrupt_skipped, instead of raising.
        even: how the epoch's samples are shared out among the ranks, which
            get whole shards and so different counts. "pad" (default):
            every rank gets as many as the rank with the most, the others
            repeating, after their own, samples from the start of the
            epoch's shard order (``stats().padded`` counts them; they are
            never part of a position, so elastic resume stays exact).
            "drop": as many as the rank with the fewest, the others leaving
            out the last samples of their order (it needs at least as many
            shards as ranks). "off": each rank its shards' samples. A job
            whose ranks step together (DDP) needs equal counts: with "off"
            and uneven counts it hangs at the epoch's end. With world_size
            1 it changes nothing; otherwise the daemon counts every shard's
            samples once (a local source's tar headers only; from S3 it
            reads through members under 1 MiB).

    Raises:
        TypeError: a field of the wrong type.
        InvalidArgumentError: an empty source, or an int outside its field
            of the protocol. Other rules (batch_size > 0, rank < world_size,
            a known format and scheme) are the daemon's, checked when the
            dataset is opened, so that one rule holds for every client.
        ValueError: rank or world_size not given and not determinable.
    """

    source: str | os.PathLike[str] | Sequence[Any]
    _: KW_ONLY
    format: str = "webdataset"
    batch_size: int = 32
    rank: int | None = None
    world_size: int | None = None
    seed: int = 0
    epoch: int = 0
    start: int = 0
    shuffle_window: int | None = None
    skip_corrupt: bool = False
    delivered: tuple[bytes, ...] = ()
    even: str = "pad"
    shuffle_block: int = 0

    def __post_init__(self) -> None:
        given: Any = self.delivered  # callers pass lists (JSON's), or by mistake one blob
        if isinstance(given, (bytes, bytearray, str)):
            raise TypeError("delivered must be a sequence of positions (bytes or base64 str)")
        delivered = tuple(_position.blob(b) for b in given)
        object.__setattr__(self, "delivered", delivered)
        for name in ("format", "even"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, not {type(getattr(self, name)).__name__}")
        if not isinstance(self.skip_corrupt, bool):
            raise TypeError(f"skip_corrupt must be a bool, not {type(self.skip_corrupt).__name__}")
        ints: dict[str, int | None] = {}
        for name in (
            "batch_size",
            "seed",
            "epoch",
            "start",
            "shuffle_window",
            "shuffle_block",
            "rank",
            "world_size",
        ):
            v = getattr(self, name)
            ints[name] = None if v is None and name in _OPTIONAL else _checked_int(name, v)
        ints["rank"], ints["world_size"] = _ranks.resolve(ints["rank"], ints["world_size"])
        for name, v in ints.items():
            object.__setattr__(self, name, v)  # plain ints, whatever __index__ gave them
        if isinstance(self.source, (str, os.PathLike)):
            object.__setattr__(self, "source", resolve_source(self.source))
        else:
            object.__setattr__(self, "source", resolve_mixture(self.source))

    @property
    def mixture(self) -> tuple[MixtureSource, ...]:
        """The sources of a mixture, as (source, weight, format); () for one source."""
        if isinstance(self.source, (str, os.PathLike)):
            return ()
        return cast("tuple[MixtureSource, ...]", tuple(self.source))

    def as_dict(self) -> dict[str, Any]:
        """The spec's fields as a dict of JSON-safe values (delivered as base64 str)."""
        return {**asdict(self), "delivered": [_position.text(b) for b in self.delivered]}

    def request(self) -> pb.OpenDatasetRequest:
        """The OpenDataset request for this spec."""
        mixture = [pb.MixtureSource(source=s, weight=w, format=f) for s, w, f in self.mixture]
        return pb.OpenDatasetRequest(
            source="" if mixture else os.fspath(cast("str", self.source)),
            mixture=mixture,
            format=self.format,
            batch_size=self.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            epoch=self.epoch,
            start=self.start,
            shuffle_window=self.shuffle_window or 0,
            shuffle_block=self.shuffle_block,
            skip_corrupt=self.skip_corrupt,
            delivered=list(self.delivered),
            even=self.even,
        )


@dataclass(frozen=True)
class DatasetStats:
    """Where the consumer's waiting went, and what the cache did.

    The ``wait_*`` times (seconds) are the daemon's: how long NextBatch calls
    of this session waited for a batch, by what the prefetcher was doing
    then -- reading a shard from storage, waiting for a shard another rank
    was reading into the cache, waiting for the consumer to give a ring
    slot back, or parsing and copying. ``client_wait`` is what the trainer
    saw: seconds spent inside next(), RPC and copies included, and
    ``elapsed`` the seconds since the first batch was asked for, so
    ``stall_fraction`` is the share of the consumer's time spent waiting on
    data.
    """

    wait_storage: float = 0.0
    wait_cache: float = 0.0
    wait_ring: float = 0.0
    wait_work: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    corrupt_skipped: int = 0
    padded: int = 0  # samples repeated to pad this rank's epoch (even="pad")
    batches: int = 0
    samples: int = 0
    client_wait: float = 0.0
    elapsed: float = 0.0

    @property
    def wait(self) -> float:
        """The daemon-side wait over all causes, in seconds."""
        return self.wait_storage + self.wait_cache + self.wait_ring + self.wait_work

    @property
    def stall_fraction(self) -> float:
        """client_wait / elapsed: 0 when data was always ready."""
        return self.client_wait / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The stats as a flat dict, derived values included (for logging)."""
        return {**asdict(self), "wait": self.wait, "stall_fraction": self.stall_fraction}


# The fields of DatasetSpec that may be None: the daemon's default, this process's.
_OPTIONAL = frozenset({"shuffle_window", "rank", "world_size"})

# The protocol's field of each (the others are int32).
_RANGES = {"seed": _limits.UINT64, "epoch": _limits.INT64, "start": _limits.INT64}


def _checked_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    v = operator.index(v)
    low, high = _RANGES.get(name, _limits.INT32)
    if not low <= v < high:
        raise InvalidArgumentError(f"{name} {v} is out of range [{low}, {high})")
    return int(v)


MixtureSource: TypeAlias = tuple[str, float, str]
"""One source of a mixture: its source, weight and format."""


def resolve_mixture(given: Any) -> tuple[MixtureSource, ...]:
    """A mixture's sources as (source, weight, format), sources resolved.

    Each is a (source, weight) or (source, weight, format) sequence, or a
    mapping with those keys (format "auto" when not given).
    """
    if isinstance(given, (bytes, bytearray)) or not isinstance(given, Sequence):
        raise TypeError(
            "source must be a str, a path, or a mixture: a sequence of (source, weight[, format])"
        )
    if not given:
        raise InvalidArgumentError("a mixture needs at least one source")
    out = []
    for i, entry in enumerate(given):
        if isinstance(entry, Mapping):
            src, weight, fmt = entry.get("source"), entry.get("weight"), entry.get("format", "auto")
        elif isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) in (2, 3):
            src, weight, fmt = entry[0], entry[1], entry[2] if len(entry) == 3 else "auto"
        else:
            raise TypeError(f"mixture source {i}: give (source, weight[, format]), not {entry!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"mixture source {i}: the weight must be a number, not {weight!r}")
        if not isinstance(fmt, str):
            raise TypeError(f"mixture source {i}: the format must be a str, not {fmt!r}")
        if not isinstance(src, (str, os.PathLike)):
            raise TypeError(f"mixture source {i}: the source must be a str or a path, not {src!r}")
        out.append((resolve_source(src), float(weight), fmt))
    return tuple(out)


def resolve_source(source: str | os.PathLike[str]) -> str:
    """A URL as given; a plain path made absolute against this process's cwd.

    The daemon runs elsewhere, so a relative path must mean what it means
    to the trainer, not to the daemon.
    """
    s = os.fspath(source)
    if not isinstance(s, str):
        raise TypeError(f"source must be a str or a path, not {type(source).__name__}")
    if not s:
        raise InvalidArgumentError("dataset source is empty")
    if "://" in s or s.startswith(("s3:", "file:")):
        return s
    return os.path.abspath(s)


@dataclass
class _Item:
    """One fetched batch and what the consumer gives back when done with it."""

    batch: list[Sample]
    lease: str
    position: int
    stats: pb.PrefetchStats
    views: list[memoryview]  # copy=False: the batch's field views, released when retired
    delivered: bytes = b""  # the batch's samples as a position (batch_delivered)


# What the prefetch thread hands over: a batch, the final stats, or its error.
_Fetched: TypeAlias = "_Item | pb.PrefetchStats | BaseException"


class _Session:
    """A dataset session in the daemon: fetches batches, gives slots back.

    Shared by the consumer and the prefetch thread (the lock guards the
    leases to give back), and never refers to the Dataset, so that an
    abandoned Dataset can be garbage-collected while the thread runs.
    """

    def __init__(self, conn: Connection, session: str, copy: bool, what: str) -> None:
        self.conn = conn
        self.stub: Any = conn.prefetch
        self.id = session
        self.copy = copy
        self.what = what
        self._cond = threading.Condition()
        self._to_release: list[str] = []
        self._held = 0  # copy=False: fetched batches whose slot is not given back
        self._closed = False

    def give_back(self, lease: str, held: bool = False) -> None:
        """Queue a slot for release with the next NextBatch (or CloseDataset)."""
        with self._cond:
            self._to_release.append(lease)
            if held:
                self._held -= 1
                self._cond.notify_all()

    def wait_for_slot(self, stop: threading.Event) -> bool:
        """Wait until fetching another batch cannot wait for a slot we hold.

        With copy=False the consumer holds its batch's slot until it asks for
        the next one. A NextBatch sent while the client holds every ring slot
        would wait forever for a slot whose release it does not carry, so
        the thread fetches only while at most the consumer's batch is held:
        two slots always suffice. False when stopped or closed meanwhile.
        """
        with self._cond:
            while self._held > 1 and not stop.is_set() and not self._closed:
                self._cond.wait(timeout=0.1)
            return not stop.is_set() and not self._closed

    def fetch(self, ahead: Callable[[], bool] = lambda: False) -> _Item | pb.PrefetchStats:
        """The next batch, or the final stats at the end of the epoch.

        ahead says whether the consumer has a batch waiting: see _copied.
        """
        with self._cond:
            release, self._to_release = self._to_release, []
        req = pb.NextBatchRequest(session=self.id, release=release)
        try:
            resp: pb.NextBatchResponse = self.conn.call(
                "NextBatch", req, f"next batch of {self.what}", self.stub
            )
        except CkptdError as e:
            raise _corrupt_shard(e) from None
        if resp.end:
            return resp.stats
        lease = resp.lease
        arena = self.conn.lease_mapping(lease.arena_id)
        arena.region(lease.offset, lease.length)  # bounds check against the mapping
        views: list[memoryview] = []
        if self.copy:
            batch = _copied(resp.samples, arena, lease.offset, lease.length, self.what, ahead)
            self.give_back(lease.id)  # the bytes are ours: the slot can go back at once
        else:
            region = arena.mem.data[lease.offset : lease.offset + lease.length]
            views.append(region.toreadonly())
            with self._cond:
                self._held += 1
            batch = _viewed(resp.samples, views[0], views, self.what)
        return _Item(batch, lease.id, resp.position, resp.stats, views, resp.delivered)

    def retire(self, item: _Item) -> None:
        """The consumer is done with item: invalidate its views, free its slot."""
        for v in item.views:
            v.release()  # slices of the region register with the buffer, not the view
        item.views.clear()
        if not self.copy:
            self.give_back(item.lease, held=True)

    def close(self) -> None:
        """CloseDataset: the daemon frees the ring (and wakes a waiting NextBatch)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        _close_session(self.stub, self.id)


class _Prefetcher:
    """A thread that keeps up to depth batches fetched ahead of the consumer.

    The RPC, the protobuf decoding and the copies out of the slot then
    overlap with the training step (which, on a GPU, mostly waits with the
    GIL released), so next() only takes a ready batch off a queue: a
    SimpleQueue, whose get is one C call, because after each training step
    the consumer pays for every Python call on its way to the batch. (With
    copy=False, one batch ahead at most: see _Session.wait_for_slot.)
    """

    def __init__(self, session: _Session, depth: int) -> None:
        self.session = session
        self.items: queue.SimpleQueue[_Fetched] = queue.SimpleQueue()
        self.graveyard: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.room = threading.Semaphore(depth)  # batches fetched and not yet taken
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"ckptd-dataset-{session.id}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while self._wait_room() and self.session.wait_for_slot(self.stop):
            self._bury()
            try:
                out: _Fetched = self.session.fetch(self._ahead)
            except BaseException as e:  # handed to the consumer, raised there
                out = e
            if self.stop.is_set():
                if isinstance(out, _Item):
                    self.session.retire(out)
                return
            self.items.put(out)
            if not isinstance(out, _Item):
                return

    def _ahead(self) -> bool:
        """Whether the consumer has a fetched batch to take (it is not waiting on us)."""
        return not self.items.empty()

    def _bury(self) -> None:
        """Free the batches the consumer is done with, here rather than in its thread.

        Freeing a batch of 100 KiB samples costs about as much as copying
        it (the allocator gives the pages back to the kernel), and the
        consumer would pay it when it drops the previous batch -- right
        after its training step, where every microsecond is stall.
        """
        while True:
            try:
                self.graveyard.get_nowait()
            except queue.Empty:
                return

    def _wait_room(self) -> bool:
        """Wait until fewer than depth batches are ahead; False once stopped."""
        while not self.stop.is_set():
            if self.room.acquire(timeout=0.1):
                return True
        return False

    def get(self) -> _Fetched:
        """The next fetched item, waiting for it; a dead thread is an error, not a hang."""
        while True:
            try:
                out = self.items.get(timeout=0.5)
            except queue.Empty:
                if not self.thread.is_alive() and self.items.empty():
                    raise CkptdError(f"{self.session.what}: the prefetch thread died") from None
                continue
            self.room.release()
            return out

    def close(self) -> None:
        """Stop the thread and retire what it fetched; the session is closed by the caller."""
        self.stop.set()
        self.room.release()  # wake it if it waits for room
        if threading.current_thread() is not self.thread:  # a GC pass may run us there
            self.thread.join(timeout=_CLOSE_TIMEOUT)
        while True:
            try:
                out = self.items.get_nowait()
            except queue.Empty:
                return
            if isinstance(out, _Item):
                self.session.retire(out)


def _cleanup(session: _Session, prefetcher: _Prefetcher | None) -> None:
    """Close a dataset: on close(), at the end, on error, or when it is collected."""
    if prefetcher is not None:
        prefetcher.stop.set()  # before CloseDataset wakes its NextBatch
        prefetcher.room.release()
    session.close()
    if prefetcher is not None:
        prefetcher.close()


class Dataset:
    """One rank's pass over one epoch of a dataset, batch by batch.

    Made by Client.dataset(). Iterate it (once) for batches: a batch is a
    list of samples, a sample a dict with ``"__key__"`` and one entry per
    field (extension), as the webdataset library does. state() is what to
    store in a checkpoint; ``client.dataset(DatasetSpec(**state))`` resumes
    exactly after the last batch returned.

    The session is closed, and its ring slots freed in the daemon, when the
    epoch ends, on close() or leaving a ``with`` block, and when the object
    is garbage-collected (so ``break`` out of a for loop over
    ``client.dataset(...)`` frees it too). Use it from one thread.
    """

    def __init__(
        self,
        conn: Connection,
        spec: DatasetSpec,
        registry: weakref.WeakSet[Dataset],
        copy: bool,
        prefetch: int,
        batch_delivered: bool = False,
    ) -> None:
        self._registry = registry  # the client's open datasets, closed with it
        self._spec = spec
        what = f"dataset {spec.source!r} epoch {spec.epoch} rank {spec.rank}"
        if conn.mapping() is None:
            raise CkptdError(
                f"{what}: datasets are delivered through the daemon's shared-memory "
                f"arena, which this client cannot map (transport={conn.transport!r})"
            )
        req = spec.request()
        req.batch_delivered = batch_delivered
        resp = conn.call("OpenDataset", req, f"open {what}", conn.prefetch)
        self.session: str = resp.session
        self.shards: int = resp.shards  # shards this rank reads this epoch
        self._session = _Session(conn, resp.session, copy, what)
        self._prefetch = prefetch
        self._prefetcher: _Prefetcher | None = None
        self._current: _Item | None = None
        self._previous: _Item | None = None
        self._position = spec.start
        self._delivered = b""  # the last batch's samples (batch_delivered)
        self._stats = pb.PrefetchStats()
        self._counts = [0, 0]  # batches, samples
        self._client_wait = 0.0
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._session, None)
        self._finalizer.atexit = False  # at exit the daemon's idle reaper frees it
        registry.add(self)

    def __repr__(self) -> str:
        return (
            f"Dataset({self._spec.source!r}, epoch={self._spec.epoch}, rank={self._spec.rank}/"
            f"{self._spec.world_size}, position={self._position}, closed={self._closed})"
        )

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[list[Sample]]:
        return self

    def __next__(self) -> list[Sample]:
        # Lean on purpose: the time spent here is the trainer's stall.
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        if self._t_first is None:
            self._t_first = t0
        if self._current is not None:
            if not self._session.copy:  # copied batches gave their slot back at once
                self._session.retire(self._current)
            if self._prefetcher is not None:
                # The caller drops the previous batch when it takes this one: keep
                # it one more round, then let the prefetch thread free it.
                if self._previous is not None:
                    self._prefetcher.graveyard.put(self._previous)
                self._previous = self._current
            self._current = None
        try:
            out = self._session.fetch() if self._prefetch <= 0 else self._prefetched()
        except BaseException:
            self._client_wait += time.perf_counter() - t0
            self.close()
            raise
        t1 = time.perf_counter()
        self._client_wait += t1 - t0
        if not isinstance(out, _Item):
            self._stats = out
            self._t_end = t1
            self.close()
            raise StopIteration
        self._current = out
        self._stats = out.stats
        self._position = out.position
        self._delivered = out.delivered
        self._counts[0] += 1
        self._counts[1] += len(out.batch)
        return out.batch

    def _prefetched(self) -> _Item | pb.PrefetchStats:
        """The next item from the prefetch thread (started on the first call)."""
        prefetcher = self._prefetcher or self._start_prefetcher()
        out = prefetcher.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def _start_prefetcher(self) -> _Prefetcher:
        """Start the thread on the first next(), so an unused dataset costs no thread."""
        self._prefetcher = _Prefetcher(self._session, self._prefetch)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self._session, self._prefetcher)
        self._finalizer.atexit = False
        return self._prefetcher

    @property
    def position(self) -> int:
        """Samples this rank has consumed this epoch, the last batch included."""
        return self._position

    def state(self, *, elastic: bool = False) -> dict[str, Any]:
        """What to store in a checkpoint: ``client.dataset(DatasetSpec(**state))`` resumes here.

        A dict of plain values (JSON-serializable: ``json.dumps`` takes it
        as it is): source, format, batch_size, rank, world_size, seed,
        epoch, shuffle_window, shuffle_block, skip_corrupt, even, delivered and start, the
        samples consumed so far this epoch (batches fetched ahead by the
        prefetch thread do not count).

        With elastic=True, the position survives a change of world size:
        start is 0 and delivered holds (one opaque position asked of the
        daemon, as base64 text) the samples this rank delivered, padding
        left out, with those it resumed from. The
        union of every rank's (``ckptd.torch.gather_dataset_state``) resumes
        the epoch at any world size. Take it while the epoch runs: a
        dataset closed (its epoch over, or close()) has no session to ask.

        Raises:
            CkptdError: elastic, and the dataset is closed.
        """
        if not elastic:
            return replace(self._spec, start=self._position).as_dict()
        if self._closed:
            raise CkptdError(
                f"dataset {self._spec.source!r} epoch {self._spec.epoch} is closed: "
                "take its elastic state while the epoch runs"
            )
        resp = self._session.conn.call(
            "DatasetPosition",
            pb.DatasetPositionRequest(session=self.session, position=self._position),
            f"position of dataset {self._spec.source!r}",
            self._session.conn.prefetch,
        )
        return replace(self._spec, start=0, delivered=(resp.delivered,)).as_dict()

    def stats(self) -> DatasetStats:
        """The session's totals as of the last batch (see DatasetStats)."""
        s = self._stats
        end = self._t_end if self._t_end is not None else time.perf_counter()
        return DatasetStats(
            wait_storage=s.wait_storage_ns / 1e9,
            wait_cache=s.wait_cache_ns / 1e9,
            wait_ring=s.wait_ring_ns / 1e9,
            wait_work=s.wait_work_ns / 1e9,
            cache_hits=s.cache_hits,
            cache_misses=s.cache_misses,
            corrupt_skipped=s.corrupt_skipped,
            padded=s.padded,
            batches=self._counts[0],
            samples=self._counts[1],
            client_wait=self._client_wait,
            elapsed=0.0 if self._t_first is None else end - self._t_first,
        )

    @property
    def closed(self) -> bool:
        """Whether the session is over (epoch done, closed, or failed)."""
        return self._closed

    def close(self) -> None:
        """End the session: the daemon frees its ring; safe to call twice.

        Memoryviews of the last batch (copy=False) are released too.
        """
        if self._closed:
            return
        self._closed = True
        if self._current is not None:
            self._session.retire(self._current)
            self._current = None
        self._previous = None
        self._registry.discard(self)
        self._finalizer()


_YIELD_EVERY = 16  # samples copied between two GIL hand-offs (~1.6 MiB of 100 KiB ones)
_YIELD_FOR = 2e-5  # seconds: long enough for a thread waiting on the GIL to take it


def _copied(
    samples: Any,
    arena: Arena,
    base: int,
    size: int,
    what: str,
    ahead: Callable[[], bool] = lambda: False,
) -> list[Sample]:
    """Samples whose fields are bytes copied out of the slot (one memcpy each).

    A batch's copies hold the GIL for milliseconds, and a trainer waking
    from its step to take a batch waits for the GIL until they end (up to
    Python's switch interval, 5 ms). So while ahead() says the trainer has
    a batch waiting, the copy hands the GIL over every _YIELD_EVERY samples
    (a short sleep: the waiting thread takes it, the copy goes on after):
    the trainer then never waits on the copy, and this batch, which
    nobody waits for yet, is only a little later. When the trainer waits
    for this very batch, nothing would gain from a hand-off.
    """
    mm = arena.mapping
    out = []
    for i, s in enumerate(samples):
        if i % _YIELD_EVERY == _YIELD_EVERY - 1 and ahead():
            time.sleep(_YIELD_FOR)
        d: Sample = {"__key__": s.key}
        for f in s.fields:
            off, end = f.offset, f.offset + f.length
            if end > size:
                raise _outside(what, s.key, f.name)
            d[f.name] = mm[base + off : base + end]
        out.append(d)
    return out


def _viewed(samples: Any, region: memoryview, views: list[memoryview], what: str) -> list[Sample]:
    """Samples whose fields are read-only views of the slot, recorded for release."""
    size = len(region)
    out = []
    for s in samples:
        d: Sample = {"__key__": s.key}
        for f in s.fields:
            off, end = f.offset, f.offset + f.length
            if end > size:
                raise _outside(what, s.key, f.name)
            v = region[off:end]
            views.append(v)
            d[f.name] = v
        out.append(d)
    return out


def _outside(what: str, key: str, field: str) -> CkptdError:
    return CkptdError(f"{what}: field {field!r} of sample {key!r} lies outside its slot")


def _corrupt_shard(e: CkptdError) -> CkptdError:
    """Turn the daemon's CORRUPT for an unparsable shard into CorruptShardError.

    The daemon names the shard in its ErrorInfo's ``shard`` metadata. An
    error without one (a corrupt checkpoint chunk, or a daemon that sends no
    ErrorInfo) stays what it is: the message's words never decide.
    """
    shard = e.metadata.get("shard")
    if e.reason != "CORRUPT" or shard is None:
        return e
    hint = " (skip_corrupt=True skips such shards and counts them)"
    return CorruptShardError(
        str(e) + hint,
        shard=shard,
        code=e.code,
        details=e.details,
        reason=e.reason,
        metadata=e.metadata,
    )


def _close_session(stub: Any, session: str) -> None:
    """Free a session's ring in the daemon; quietly, as it runs on cleanup.

    A client closed first, a daemon gone, or a session the daemon already
    reaped all leave nothing to do.
    """
    with contextlib.suppress(grpc.RpcError, ValueError):
        stub.CloseDataset(pb.CloseDatasetRequest(session=session), timeout=_CLOSE_TIMEOUT)
