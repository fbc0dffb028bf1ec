"""The ckptd client: a thin facade over the connection, saves, loads and datasets.

Client holds one Connection (channel, trust checks, arena mapping, retries:
_transport.py) and the client's attempt; saving is in _save.py, loading and
listing in _load.py, the handles that follow saves in _handle.py, datasets
in _dataset.py.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from . import _attempt, _kinds, _limits, _load, _ranks, _save
from ._dataset import Dataset, DatasetSpec
from ._handle import SaveHandle, SaveStatus
from ._load import LoadedState, StepInfo
from ._transport import (
    Connection,
    Transport,
    check_transport,
    default_socket,
    resolve_reconnect_timeout,
)

__all__ = [
    "Client",
    "LoadedState",
    "SaveHandle",
    "SaveStatus",
    "StepInfo",
    "Transport",
    "default_socket",
]


class Client:
    """A connection to one ``ckptd serve`` over its unix socket.

    Args:
        socket: the daemon's socket; default: see default_socket(). Before
            the first call the client checks the socket, its folder and the
            uid of the process behind it, and raises UntrustedDaemonError
            (sending nothing) unless they belong to this user, root or
            $CKPTD_DAEMON_UID.
        timeout: seconds allowed for each call to the daemon (None: no limit).
            A save that finds the arena full waits up to the daemon's
            --staging-wait before failing, whatever this says.
        transport: "shm" maps the arena (the fast path); "stream" sends the
            bytes over gRPC (for a client that cannot see the daemon's
            /dev/shm); "auto" maps and falls back to streaming, with a
            warning, when the arena cannot be opened.
        attempt: the run of the job this client's saves belong to, shared by
            every rank of the run and different for the next run
            ([a-z0-9._-]{1,64}, not starting with "."). Default
            $CKPTD_ATTEMPT, else a random id of this client's own, which
            suits a single rank only: ranks of one run must share an attempt
            (see the README).
        reconnect_timeout: seconds save(), load(), steps(), latest_step()
            and SaveHandle.wait() wait for a daemon that went away (a
            restart) or is not there yet, retrying, before they raise
            DaemonUnavailableError; 0 raises at once. Default
            $CKPTD_RECONNECT_TIMEOUT, else 30. Errors that mean the request
            is wrong are never retried.

    The connection is lazy: creating a client never fails because no daemon
    runs; the first call does, naming the socket. It fails at once for a
    malformed attempt or $CKPTD_DAEMON_UID. Use it as a context
    manager, or call close(). It may be shared between threads.
    """

    def __init__(
        self,
        socket: str | None = None,
        *,
        timeout: float | None = None,
        transport: Transport = "auto",
        attempt: str | None = None,
        reconnect_timeout: float | None = None,
    ) -> None:
        transport = check_transport(transport)
        reconnect = resolve_reconnect_timeout(reconnect_timeout)
        self._attempt, given = _attempt.resolve(attempt)
        self._attempt_random = not given  # made up here: unknown to the other ranks
        self._warned_attempt = False
        self._conn = Connection(socket, timeout, transport, reconnect)
        self._datasets: weakref.WeakSet[Dataset] = weakref.WeakSet()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Client(socket={self.socket!r}, transport={self.transport!r}, "
            f"attempt={self._attempt!r})"
        )

    @property
    def attempt(self) -> str:
        """The attempt this client's saves carry unless save() is given another."""
        return self._attempt

    @property
    def socket(self) -> str:
        """The daemon's socket (an absolute path)."""
        return self._conn.socket

    @property
    def transport(self) -> Transport:
        """How saves and loads travel: "shm", "stream" or "auto" (see the class).

        "auto" becomes "stream" once the arena turns out not to be mappable.
        """
        return self._conn.transport

    @property
    def timeout(self) -> float | None:
        """Seconds allowed for each call to the daemon (None: no limit)."""
        return self._conn.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._conn.timeout = value

    @property
    def reconnect_timeout(self) -> float:
        """Seconds calls wait for a daemon that went away (see the class)."""
        return self._conn.reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, value: float) -> None:
        self._conn.reconnect_timeout = resolve_reconnect_timeout(value)

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._conn.closed

    def close(self) -> None:
        """Close the connection and unmap the arena.

        Pending saves go on in the daemon; only their handles stop working.
        """
        if self._conn.closed:
            return
        for ds in list(self._datasets):
            ds.close()  # frees their rings in the daemon now, not after its idle timeout
        self._conn.close()

    # ---- datasets ------------------------------------------------------

    def dataset(self, spec: DatasetSpec, *, copy: bool = True, prefetch: int = 2) -> Dataset:
        """Open one rank's pass over one epoch of a dataset; iterate it for batches.

        The daemon lists the source, reads shards ahead of the trainer into
        its cache (shared by every rank on the node), cuts them into
        samples and delivers batches through ring slots in the arena. A
        batch is a list of samples; a sample is a dict with ``"__key__"``
        and one entry per extension (``"jpg"``, ``"cls"``, ...), as the
        webdataset library gives them.

        Args:
            spec: the dataset, the epoch and this rank's place in it (see
                DatasetSpec, which documents the order).
                ``Dataset.state()`` is what to checkpoint;
                ``client.dataset(DatasetSpec(**state))`` resumes exactly.
            copy: True (default) copies each field into ``bytes`` that the
                caller owns. False gives read-only memoryviews into the
                shared-memory slot, without a copy, valid only until the
                next batch is requested (then released: using one raises
                ValueError). Numpy arrays made from them are not protected.
            prefetch: batches a background thread fetches ahead (RPC,
                decoding, copies), so that they overlap with the training
                step and next() only takes a ready batch; 0 fetches inside
                next(). With copy=False the views pin their slot, so the
                thread fetches one batch ahead at most (two ring slots
                always suffice).

        Raises:
            TypeError: spec is not a DatasetSpec.
            InvalidArgumentError: batch_size <= 0, rank outside
                [0, world_size), a source with no objects (no ``.tar``
                shards for webdataset), an unknown format or scheme.
            CorruptShardError: (while iterating) a shard cannot be parsed;
                it names the shard.
            DaemonUnavailableError: no daemon answers on the socket.
        """
        if not isinstance(spec, DatasetSpec):
            raise TypeError(
                f"Client.dataset takes a ckptd.DatasetSpec, not {type(spec).__name__}: "
                "e.g. client.dataset(ckptd.DatasetSpec(source, batch_size=32))"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, not {prefetch!r}")
        return Dataset(self._conn, spec, self._datasets, copy=bool(copy), prefetch=prefetch)

    # ---- save ----------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        metadata: bytes = b"",
        job: str | None = None,
        attempt: str | None = None,
    ) -> SaveHandle:
        """Stage one rank's shard of a step; return as soon as the daemon has it.

        ``state`` is a dict, possibly nested, of numpy arrays and torch tensors
        (any dtype ckptd knows, any strides, on CPU or CUDA). Each tensor is
        copied once, straight into the shared-memory region; after that the
        caller may change or free its tensors. The shard becomes durable in
        the background: see SaveHandle.wait().

        rank and world_size default to this process's: torch.distributed's
        when it is initialized, else $RANK and $WORLD_SIZE, else 0 and 1 --
        unless a launcher of several processes is detected ($LOCAL_RANK,
        $SLURM_NTASKS > 1, ...), which raises ValueError rather than save
        every process as rank 0 of 1. metadata is the trainer's own bytes
        (a loader position, ...), given back by load(); job defaults to
        the daemon's.

        Which values were torch tensors (and which numpy arrays) is
        recorded with the shard, in empty tensors under ``ckptd.as`` (a
        reserved top-level key), so that load() gives each back as it came.

        The save carries attempt (default: the client's). A step commits
        from the saves of one attempt, so every rank of world_size must save
        it under the same one; a client that made its attempt up itself
        warns, once, when it saves with world_size > 1.

        A daemon that goes away (a restart) is waited for, up to the
        client's reconnect_timeout, and the save is made again from the
        start (the lease died with the daemon). A save whose commit reached
        the daemon just before it went away is not made twice: the
        restarted daemon says it has it, and that counts as accepted.

        Raises:
            TypeError: a value or key of state cannot be stored.
            ValueError: rank or world_size not given and not determinable.
            InvalidArgumentError: the step, rank, job, attempt or a name is
                refused.
            AlreadyExistsError: the step is committed, or this rank of this
                attempt is already being saved.
            ResourceExhaustedError: the arena stayed full (or is too small).
            DaemonUnavailableError: no daemon answered within reconnect_timeout.
            UntrustedDaemonError: the daemon on the socket is not trusted.
        """
        meta = _save.metadata_bytes(metadata)
        own = attempt is None
        attempt = self._attempt if own else _attempt.check(attempt, "attempt")
        rank, world_size = _ranks.resolve(rank, world_size)
        target = _save.target(job, step, rank, world_size, attempt)
        if own and self._attempt_random and target.world_size > 1:
            self._warn_random_attempt(target.world_size)
        return _save.save(self._conn, target, _kinds.mark(state), meta)

    def _warn_random_attempt(self, world_size: int) -> None:
        if self._warned_attempt:
            return
        self._warned_attempt = True
        warnings.warn(
            f"ckptd: saving one of {world_size} ranks under attempt {self._attempt!r}, a random "
            "id this client made up; every rank's client makes its own, and a step commits "
            f"only from the saves of one attempt. Give the ranks of a run one attempt: "
            f"{_attempt.HOWTO}, or save through ckptd.torch with torch.distributed initialized",
            RuntimeWarning,
            stacklevel=3,
        )

    def handle(
        self,
        step: int,
        *,
        rank: int | None = None,
        job: str | None = None,
        attempt: str | None = None,
    ) -> SaveHandle:
        """A handle on a save made earlier, to wait for it (rank: default this process's).

        For another process, or a trainer that restarted, while the save was
        still draining. It follows the save of attempt (default: this
        client's; "" for whichever save of the target the daemon knows of,
        e.g. one of a previous run). wait() raises NotFoundError when the
        daemon knows of no such save and storage has none.
        """
        if attempt is None:
            attempt = self._attempt
        elif attempt:
            _attempt.check(attempt, "attempt")
        step, rank = _limits.as_int("step", step), _limits.as_int("rank", _ranks.rank(rank))
        return SaveHandle(self._conn, job or "", step, rank, attempt=attempt)

    # ---- load ----------------------------------------------------------

    def load(
        self,
        step: int | Literal["latest"],
        *,
        rank: int | None = None,
        job: str | None = None,
        as_torch: bool | None = None,
        device: Any = None,
        nested: bool = True,
        tensors: Sequence[str] | None = None,
        finite: bool = False,
        into: Mapping[str, Any] | None = None,
    ) -> LoadedState:
        """Restore one rank's shard of a committed step, or some of its tensors.

        Every chunk is verified against its hash by the daemon. Tensors are
        copied once out of the shared-memory region into memory they own
        (the region is released before load returns), so they stay valid
        and writable for as long as the caller keeps them.

        Args:
            step: the step to load, or "latest" for the newest committed one.
            rank: which rank's shard (default: this process's, as in save()).
            job: the job (None: the daemon's default).
            as_torch: None (default): each value as it was saved -- a torch
                tensor where the save had one (on the CPU), a numpy array
                where it had one, and numpy arrays for steps saved by an
                older client or without torch. True: torch tensors (CPU
                unless device says otherwise). False: numpy arrays.
            device: a torch device ("cuda:0", ...) to load straight onto;
                implies as_torch. From CUDA-registered memory this is DMA.
            nested: rebuild the nesting of the saved dict (default); False
                returns the flat tensor names as stored.
            tensors: only these tensors, by their stored (flat) names: the
                daemon reads only their chunks. An unknown name raises
                InvalidArgumentError.
            finite: with "latest", the newest committed step whose tensors
                hold no NaN or Inf (the daemon counts them as it drains): a
                run that diverged restarts from before it did. The steps
                passed over are in the result's .skipped_nonfinite, and
                logged. Steps kept in memory only are not considered.
            into: existing tensors to load straight into, by stored (flat)
                name: a model's parameters, say, so that no second copy of
                the state is made. Each one of the saved dtype and shape,
                dense and writable (a contiguous torch tensor on the CPU or
                a CUDA device that does not require grad, or a C-contiguous
                numpy array) gets the saved bytes in place and is returned
                as itself; any other is left alone and a new tensor
                returned for its name, as without into. Should the load
                fail after the copies began, into's tensors may hold some
                of the saved bytes.

        Where a numpy array comes back (as_torch=False, or None for a value
        saved from numpy), bfloat16 and float8 tensors, which numpy cannot
        represent, come back as torch tensors when torch is installed, else
        as their raw bits (uint16 or uint8 arrays). With tensors=, the
        record of what was torch is not read: as_torch=None gives numpy
        arrays there (ask as_torch=True for torch).

        Returns:
            The state dict, with .step, .world_size, .metadata and
            .skipped_nonfinite attributes.

        Raises:
            ValueError: step is a str other than "latest"; rank not given
                and not determinable.
            NotFoundError: no such committed step, or no such rank.
            DataLossError: stored data failed verification.
        """
        rank = _ranks.rank(rank)
        req = _load.restore_request(step, rank, job, tensors, finite)
        what = f"load {'latest step' if req.latest else f'step {step}'} rank {rank}"
        return _load.load(self._conn, req, what, as_torch, device, nested, into)

    # ---- listing -------------------------------------------------------

    def steps(self, job: str | None = None) -> list[StepInfo]:
        """The committed steps of job (default: the daemon's), oldest first.

        Waits up to reconnect_timeout for a daemon that went away.
        """
        return _load.steps(self._conn, job)

    def latest_step(self, job: str | None = None) -> int | None:
        """The newest committed step of job, or None when there is none (see steps())."""
        steps = self.steps(job)
        return steps[-1].step if steps else None
