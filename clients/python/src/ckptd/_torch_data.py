"""A torch IterableDataset over a ckptd dataset, for torch's DataLoader.

The daemon already batches, so the DataLoader must not: use it with
``batch_size=None``. Each DataLoader worker is one more reader of the
dataset: worker ``w`` of ``W`` on rank ``r`` of ``R`` reads as rank
``r * W + w`` of ``R * W``. The daemon's order deals shards round-robin to
those readers, so every sample comes exactly once per epoch over all ranks
and workers; with the spec's ``even`` (default "pad") every reader, and so
every rank, gets the same number of samples and batches, as a DDP job
needs (off when the trainer's world size is 1: the workers of one rank
need no equal counts).

gRPC channels do not survive fork(), so the dataset holds only its settings
and every ``__iter__`` -- which the DataLoader runs inside the worker --
opens a client of its own. Any multiprocessing context works (fork, spawn,
forkserver).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch.utils.data

from ._client import Client
from ._dataset import DatasetSpec, Sample


class Batch(list):  # type: ignore[type-arg]
    """A batch of samples, tagged with where its reader stands in the epoch.

    A plain list for every other purpose (it survives pickling between
    DataLoader processes and pin_memory, which both copy attributes).
    """

    epoch: int
    worker: int
    num_workers: int
    position: int  # samples the worker had delivered once this batch was made


class BatchDict(dict):  # type: ignore[type-arg]
    """A collate_fn's dict result, tagged like Batch."""

    epoch: int
    worker: int
    num_workers: int
    position: int


class CkptdIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches from ``ckptd serve``'s prefetching cache, as a torch IterableDataset.

    Typical use, one per rank::

        spec = ckptd.DatasetSpec("s3://bucket/train/", batch_size=64, seed=0)
        ds = CkptdIterableDataset(spec, transform=decode)
        loader = DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True)
        ds.load_state_dict(ckpt["data"])            # when resuming
        for epoch in range(ds.epoch, epochs):
            ds.set_epoch(epoch)
            for batch in loader:
                ds.observe(batch)                   # tracks the position to checkpoint
                ...
                ckpt["data"] = ds.state_dict()

    Args:
        spec: as Client.dataset: the source, format, batch size, seed, the
            first epoch, shuffle_window, skip_corrupt, and the trainer's
            rank and world_size (by default this process's), which the
            workers subdivide. Its start must be 0: the position is resumed
            with load_state_dict, per worker.
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

    The DataLoader re-creates its workers each epoch (unless
    persistent_workers=True, which would keep the old epoch), so set_epoch
    before iterating works like DistributedSampler's.
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
        if spec.start != 0:
            raise ValueError(
                f"spec.start is {spec.start}: CkptdIterableDataset resumes with "
                "load_state_dict(), which holds each DataLoader worker's position"
            )
        self.spec = spec  # the epoch is self.epoch, which set_epoch changes
        self.epoch = spec.epoch
        self.socket = socket
        self.timeout = timeout
        self.transform = transform
        self.collate_fn = collate_fn
        self.copy = copy
        self.prefetch = prefetch
        self._starts: list[int] | None = None  # per worker, from load_state_dict
        self._positions: dict[int, int] = {}
        self._num_workers: int | None = None

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

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch next (from its start, unless load_state_dict says otherwise)."""
        if epoch != self.epoch:
            self._starts = None
            self._positions = {}
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _worker()
        start = self._start(worker, workers)
        with (
            Client(self.socket, timeout=self.timeout) as c,
            c.dataset(
                replace(
                    self.spec,
                    rank=self.rank * workers + worker,
                    world_size=self.world_size * workers,
                    epoch=self.epoch,
                    start=start,
                    even=self.spec.even if self.world_size > 1 else "off",
                ),
                copy=self.copy,
                prefetch=self.prefetch,
            ) as ds,
        ):
            for batch in ds:
                out = self._finish(batch, worker, workers, ds.position)
                self._record(worker, workers, ds.position)  # in-process: num_workers=0
                yield out

    def _start(self, worker: int, workers: int) -> int:
        """Where this worker resumes: from load_state_dict, else 0."""
        if self._starts is None:
            return 0
        if len(self._starts) != workers:
            raise ValueError(
                f"the loader state was saved with {len(self._starts)} DataLoader workers per "
                f"rank, and this DataLoader has {workers}: resume with the same num_workers "
                "(each worker reads its own part of the epoch)"
            )
        return self._starts[worker]

    def _finish(self, batch: list[Sample], worker: int, workers: int, position: int) -> Any:
        """Transform, collate and tag one batch, in the worker."""
        samples: list[Any] = batch if self.transform is None else [self.transform(s) for s in batch]
        out: Any = Batch(samples) if self.collate_fn is None else self.collate_fn(samples)
        if isinstance(out, dict) and not isinstance(out, BatchDict):
            out = BatchDict(out)
        if isinstance(out, (Batch, BatchDict)):
            out.epoch, out.worker, out.num_workers, out.position = (
                self.epoch,
                worker,
                workers,
                position,
            )
        return out

    def _record(self, worker: int, workers: int, position: int) -> None:
        if self._num_workers != workers:
            self._positions = {}
            self._num_workers = workers
        self._positions[worker] = position

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
        self.epoch = batch.epoch
        self._record(batch.worker, batch.num_workers, batch.position)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position to store in a checkpoint (plain ints and lists: JSON-able).

        Each worker's position is the samples of the batches observed from
        it; load_state_dict(state) before iterating resumes after them.
        """
        workers = self._num_workers or 1
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": workers,
            "positions": [self._positions.get(w, 0) for w in range(workers)],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume where state_dict said: the epoch, and each worker's position.

        The DataLoader must have the same num_workers as when it was saved,
        and the dataset the same seed, rank and world_size.
        """
        for key in ("seed", "rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]}, this dataset {getattr(self, key)}: "
                    "the order would differ, so the positions would not mean the same samples"
                )
        positions = [int(p) for p in state["positions"]]
        if len(positions) != int(state["num_workers"]):
            raise ValueError("loader state: positions must have num_workers entries")
        self.epoch = int(state["epoch"])
        self._starts = positions
        self._num_workers = len(positions)
        self._positions = dict(enumerate(positions))


def _worker() -> tuple[int, int]:
    """(worker id, workers) of the DataLoader worker running this, (0, 1) in-process."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _int(v: int | None) -> int:
    """A rank or world size of a DatasetSpec: always set once it is made."""
    assert v is not None
    return v
