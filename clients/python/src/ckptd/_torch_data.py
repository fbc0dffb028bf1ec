"""A torch IterableDataset over a ckptd dataset, for torch's DataLoader.

The daemon already batches, so the DataLoader must not: use it with
``batch_size=None``. Each DataLoader worker is one more reader of the
dataset: worker ``w`` of ``W`` on rank ``r`` of ``R`` reads as rank
``r * W + w`` of ``R * W``. The daemon's order deals shards round-robin to
those readers, so every sample comes exactly once per epoch over all ranks
and workers; with the spec's ``even`` (default "pad") every reader, and so
every rank, gets the same number of samples and batches, as a DDP job
needs (a reader without a shard is padded; it never duplicates what
others read, except as padding).

A client's connections cannot be shared across fork(), so the dataset holds
only its settings and every ``__iter__`` -- which the DataLoader runs inside
the worker -- opens a client of its own. Any multiprocessing context works
(fork, spawn, forkserver): the client's channel is fork-safe (_h2). The
epoch and the resume in effect live in a small block of shared memory that
the workers inherit, so that ``set_epoch`` reaches persistent workers
(``persistent_workers=True``) too.
"""

from __future__ import annotations

import ctypes
import multiprocessing.context
import multiprocessing.sharedctypes
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.utils.data

from . import _position
from ._client import Client
from ._dataset import Dataset, DatasetSpec, Sample


class Batch(list):  # type: ignore[type-arg]
    """A batch of samples, tagged with where its reader stands in the epoch.

    A plain list for every other purpose (it survives pickling between
    DataLoader processes and pin_memory, which both copy attributes).
    """

    epoch: int
    worker: int
    num_workers: int
    position: int  # samples the worker had delivered once this batch was made
    delivered: bytes  # the batch's samples, as a position (padding left out)


class BatchDict(dict):  # type: ignore[type-arg]
    """A collate_fn's dict result, tagged like Batch."""

    epoch: int
    worker: int
    num_workers: int
    position: int
    delivered: bytes


@dataclass(frozen=True)
class _Resume:
    """A loaded state_dict: where each reader resumes in its epoch."""

    id: int
    epoch: int
    world_size: int
    rank: int | None  # None: gathered, every rank's
    num_workers: int | None  # None: no batch was observed (every position is 0)
    positions: dict[int, list[int]]  # by rank: each worker's position ([]: all 0)
    base: bytes  # the position the saved epoch itself resumed from
    delivered: bytes | None  # every sample delivered (None: a state from before it)

    def plan(self, rank: int, world_size: int, worker: int, workers: int) -> tuple[int, bytes]:
        """(start, delivered) to open this reader's epoch with.

        The same topology replays the saved order (start at the worker's
        position); another resumes from the samples delivered, dealt anew
        among the readers there are now.
        """
        if self._replays(rank, world_size, workers):
            ps = self.positions[rank]
            return ps[worker] if ps else 0, self.base
        if self.delivered is None:
            raise ValueError(
                f"the loader state was saved with {self.num_workers} DataLoader workers per rank "
                f"at world size {self.world_size}, and this DataLoader has {workers} at "
                f"{world_size}; this state (from an older ckptd) holds positions only: resume "
                "with the same num_workers and world size"
            )
        if self.rank is not None and self.world_size > 1:
            raise ValueError(
                f"the loader state holds rank {self.rank} of {self.world_size}'s position only, "
                f"saved with {self.num_workers} DataLoader workers; to resume with {workers} "
                f"workers per rank at world size {world_size}, checkpoint every rank's, gathered "
                "with ckptd.torch.gather_dataset_state(dataset) (a collective), and load that"
            )
        return 0, self.delivered

    def view(self, rank: int, world_size: int, seed: int) -> dict[str, Any]:
        """This rank's state_dict while it has observed nothing since loading this."""
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "seed": seed,
            "rank": rank,
            "world_size": world_size,
            "num_workers": None,
            "positions": [],
            "base": _position.text(self.base),
            "delivered": _position.text(self.delivered or b""),
        }
        ps = self.positions.get(rank)
        if world_size == self.world_size and ps is not None:  # the saved order goes on
            out["num_workers"], out["positions"] = self.num_workers, list(ps)
        elif self.delivered is not None:  # a new deal of what is left, from its start
            out["base"] = out["delivered"]
        return out

    def replays(self, rank: int, world_size: int, workers: int) -> bool:
        """Whether the reader replays the saved order (else it resumes elastically)."""
        return self._replays(rank, world_size, workers)

    def _replays(self, rank: int, world_size: int, workers: int) -> bool:
        if world_size != self.world_size or rank not in self.positions:
            return False
        ps = self.positions[rank]
        return not ps or (workers == self.num_workers and len(ps) == workers)


class CkptdIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches from ``ckptd serve``'s prefetching cache, as a torch IterableDataset.

    Typical use, one per rank::

        spec = ckptd.DatasetSpec("s3://bucket/train/", batch_size=64, seed=0)
        ds = CkptdIterableDataset(spec, transform=decode)
        ds.load_state_dict(ckpt["data"])            # when resuming: before the loader starts
        loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True,
                            persistent_workers=True)
        for epoch in range(ds.epoch, epochs):
            ds.set_epoch(epoch)
            for batch in loader:
                ds.observe(batch)                   # tracks the position to checkpoint
                ...
                ckpt["data"] = ds.state_dict()      # or gather_dataset_state(ds), see below

    Args:
        spec: as Client.dataset: the source, format, batch size, seed, the
            first epoch, shuffle_window, skip_corrupt, even, and the
            trainer's rank and world_size (by default this process's),
            which the workers subdivide. Its start must be 0 and its
            delivered empty: the position is resumed with load_state_dict.
            even applies across the ranks' workers (every worker of every
            rank delivers the same count); with world_size 1 it is off.
        socket: the daemon's socket (default: $CKPTD_SOCKET or the daemon's).
        timeout: per-call timeout of each worker's client.
        transform: applied to each sample (a dict of bytes) in the worker,
            e.g. to decode images into tensors.
        collate_fn: applied to each batch (the list of transformed samples)
            in the worker, e.g. torch.utils.data.default_collate. Without it
            a batch is a Batch (a list).
        copy: passed to Client.dataset. Keep True unless transform copies
            what it keeps (the views die with the next batch, and views
            cannot be sent from a worker process).
        prefetch: passed to Client.dataset (batches fetched ahead by a
            thread of each reader).

    set_epoch before iterating works like DistributedSampler's, with the
    DataLoader's workers made anew each epoch or kept (persistent_workers).
    """

    def __init__(
        self,
        spec: DatasetSpec,
        *,
        socket: str | None = None,
        timeout: float | None = None,
        transform: Callable[[Sample], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        copy: bool = True,
        prefetch: int = 2,
    ) -> None:
        super().__init__()
        if not isinstance(spec, DatasetSpec):
            raise TypeError(
                f"CkptdIterableDataset takes a ckptd.DatasetSpec, not {type(spec).__name__}: "
                "e.g. CkptdIterableDataset(ckptd.DatasetSpec(source, batch_size=32))"
            )
        if spec.start != 0 or spec.delivered:
            raise ValueError(
                "spec.start and spec.delivered must be left out: CkptdIterableDataset resumes "
                "with load_state_dict(), which holds each DataLoader worker's position"
            )
        self.spec = spec  # the epoch is self.epoch, which set_epoch changes
        self.socket = socket
        self.timeout = timeout
        self.transform = transform
        self.collate_fn = collate_fn
        self.copy = copy
        self.prefetch = prefetch
        # The epoch and the id of the resume in effect (0: none), which the
        # DataLoader's workers read: they hold copies of this object made
        # when they started (and kept, with persistent workers).
        self._control = _new_control()
        self._resume: _Resume | None = None
        self._resumes = 0
        self._positions: dict[int, int] = {}
        self._num_workers: int | None = None
        self._base = b""  # what the epoch resumed from
        self._seen = _position.Position()  # base, and every batch observed
        self._set(spec.epoch, 0)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (set_epoch changes it)."""
        return int(self._control[0])

    @property
    def rank(self) -> int:
        """The trainer's rank (the spec's)."""
        return _int(self.spec.rank)

    @property
    def world_size(self) -> int:
        """The trainer's world size (the spec's)."""
        return _int(self.spec.world_size)

    @property
    def seed(self) -> int:
        """The shuffling seed (the spec's)."""
        return self.spec.seed

    def _set(self, epoch: int, resume: int) -> None:
        self._control[0], self._control[1] = epoch, resume

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch next (from its start, unless load_state_dict says otherwise).

        The DataLoader's workers, persistent ones included, read it when
        they start the next iteration.
        """
        epoch = int(epoch)
        if epoch != self.epoch:
            self._positions, self._num_workers = {}, None
            self._base, self._seen = b"", _position.Position()
        resume = self._resume
        if resume is not None and resume.epoch != epoch:
            self._resume = resume = None
        self._set(epoch, 0 if resume is None else resume.id)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:  # not a worker being started
            state["_control"] = list(self._control)  # plain pickling (copy, torch.save)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        control = state["_control"]
        if isinstance(control, list):
            state["_control"] = _new_control()
            state["_control"][:] = control
        self.__dict__.update(state)

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _worker()
        epoch, rid = int(self._control[0]), int(self._control[1])
        resume = self._resume
        if rid != 0 and (resume is None or resume.id != rid):
            raise ValueError(
                "load_state_dict() was called after this DataLoader's workers started (they "
                "are persistent, and hold the dataset as it was then): call it before the "
                "DataLoader first iterates, or make a new DataLoader"
            )
        start, delivered = 0, b""
        if resume is not None and rid != 0:
            start, delivered = resume.plan(self.rank, self.world_size, worker, workers)
        spec = replace(
            self.spec,
            rank=self.rank * workers + worker,
            world_size=self.world_size * workers,
            epoch=epoch,
            start=start,
            delivered=(delivered,) if delivered else (),
            even=self.spec.even if self.world_size > 1 else "off",
        )
        in_process = torch.utils.data.get_worker_info() is None
        with Client(self.socket, timeout=self.timeout) as c:
            ds = Dataset(
                c._conn,
                spec,
                c._datasets,
                copy=bool(self.copy),
                prefetch=self.prefetch,
                batch_delivered=True,
            )
            with ds:
                for batch in ds:
                    out = self._finish(batch, epoch, worker, workers, ds.position, ds._delivered)
                    if in_process:  # a worker's copy must not touch the shared epoch
                        self._record(epoch, worker, workers, ds.position, ds._delivered)
                    yield out

    def _finish(
        self,
        batch: list[Sample],
        epoch: int,
        worker: int,
        workers: int,
        position: int,
        delivered: bytes,
    ) -> Any:
        """Transform, collate and tag one batch, in the worker."""
        samples: list[Any] = batch if self.transform is None else [self.transform(s) for s in batch]
        out: Any = Batch(samples) if self.collate_fn is None else self.collate_fn(samples)
        if isinstance(out, dict) and not isinstance(out, BatchDict):
            out = BatchDict(out)
        if isinstance(out, (Batch, BatchDict)):
            out.epoch, out.worker, out.num_workers, out.position = epoch, worker, workers, position
            out.delivered = delivered
        return out

    def _record(
        self, epoch: int, worker: int, workers: int, position: int, delivered: bytes
    ) -> None:
        if epoch != self.epoch:
            self.set_epoch(epoch)
        if self._num_workers != workers:
            self._positions, self._num_workers = {}, workers
            self._base, self._seen = b"", _position.Position()
            resume = self._resume
            if resume is not None and resume.epoch == epoch and self._control[1] == resume.id:
                if resume.replays(self.rank, self.world_size, workers):
                    self._base = resume.base
                elif resume.delivered is not None:
                    self._base = resume.delivered
                if resume.delivered is not None:
                    self._seen.add(resume.delivered)
            if self._base:
                self._seen.add(self._base)
        self._positions[worker] = position
        if delivered:
            self._seen.add(delivered)

    def observe(self, batch: Any) -> Any:
        """Record the position of a batch the training loop consumed; return it.

        Needed with num_workers > 0, where batches are made in worker
        processes that this object never hears from (harmless with 0).
        """
        if not isinstance(batch, (Batch, BatchDict)):
            raise TypeError(
                "observe() needs the Batch (or dict) this dataset yields, as the DataLoader "
                f"passes it on; got {type(batch).__name__} (a collate_fn that returns neither "
                "loses the position tag)"
            )
        self._record(
            batch.epoch,
            batch.worker,
            batch.num_workers,
            batch.position,
            getattr(batch, "delivered", b""),
        )
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position to store in a checkpoint: plain ints, lists and str (JSON-safe).

        Each worker's position is the samples of the batches observed from
        it, and delivered every sample they hold (with the epoch's start);
        load_state_dict(state) before iterating resumes after them: at the
        same world size and num_workers exactly where each worker was,
        and otherwise (a state of every rank, ``gather_dataset_state``)
        dealing what is left among the readers there are then.
        """
        workers = self._num_workers
        resume = self._resume
        if workers is None and resume is not None and self._control[1] == resume.id:
            return resume.view(self.rank, self.world_size, self.seed)  # nothing observed since
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": workers,  # None until a batch is observed
            "positions": [self._positions.get(w, 0) for w in range(workers or 0)],
            "base": _position.text(self._base),
            "delivered": _position.text(self._seen.encode()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume where state_dict (or gather_dataset_state) said.

        Call it before the DataLoader first iterates (its workers copy the
        dataset when they start). The seed must be the one saved. A state
        of one rank (state_dict) resumes that rank at the same world size
        and num_workers, or, saved at world size 1, at any; a gathered
        state (``ckptd.torch.gather_dataset_state(ds)``) resumes every rank
        at any world size and num_workers, each sample delivered once.
        """
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state has seed={state['seed']}, this dataset {self.seed}: the order "
                "would differ, so the positions would not mean the same samples"
            )
        rank = state["rank"]
        world_size = int(state["world_size"])
        workers = None if state["num_workers"] is None else int(state["num_workers"])
        raw = state["positions"]
        if rank is None:
            positions = {r: [int(p) for p in ps] for r, ps in enumerate(raw)}
        else:
            positions = {int(rank): [int(p) for p in raw]}
        if any(ps and len(ps) != workers for ps in positions.values()):
            raise ValueError("loader state: positions must have num_workers entries")
        if rank is not None and "delivered" not in state:  # from an older ckptd
            for key in ("rank", "world_size"):
                if state[key] != getattr(self, key):
                    raise ValueError(
                        f"loader state has {key}={state[key]}, this dataset "
                        f"{getattr(self, key)}: the order would differ, so the positions "
                        "would not mean the same samples"
                    )
        self._resumes += 1
        delivered = state.get("delivered")
        self._resume = _Resume(
            id=self._resumes,
            epoch=int(state["epoch"]),
            world_size=world_size,
            rank=None if rank is None else int(rank),
            num_workers=workers,
            positions=positions,
            base=_position.blob(state.get("base", ""), "base"),
            delivered=None if delivered is None else _position.blob(delivered),
        )
        self._positions, self._num_workers = {}, None
        self._base, self._seen = b"", _position.Position()
        self._set(self._resume.epoch, self._resume.id)

    @staticmethod
    def gathered(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Every rank's state_dict, in rank order, as one state resuming every rank anywhere.

        What ``gather_dataset_state(ds)`` returns, for states gathered otherwise.
        """
        first = states[0]
        workers = {s["num_workers"] for s in states} - {None}
        for r, s in enumerate(states):
            if s["rank"] != r or s["epoch"] != first["epoch"] or len(workers) > 1:
                raise ValueError(
                    f"gather_dataset_state: rank {r} passed the state of rank {s['rank']}, "
                    f"epoch {s['epoch']}, {s['num_workers']} workers; every rank must pass its "
                    f"own dataset of epoch {first['epoch']}, with as many workers "
                    f"({sorted(workers)} seen)"
                )
        delivered = _position.union(_position.blob(s["delivered"]) for s in states)
        return {
            **first,
            "rank": None,
            "num_workers": workers.pop() if workers else None,
            "positions": [list(s["positions"]) for s in states],
            "delivered": _position.text(delivered),
        }


def _new_control() -> Any:
    """Two int64 in shared memory, inherited (or passed at spawn) by workers."""
    return multiprocessing.sharedctypes.RawArray(ctypes.c_int64, 2)


def _worker() -> tuple[int, int]:
    """(worker id, workers) of the DataLoader worker running this, (0, 1) in-process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _int(v: int | None) -> int:
    """A rank or world size of a DatasetSpec: always set once it is made."""
    assert v is not None
    return v
