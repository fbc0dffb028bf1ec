"""Saving one rank's shard: the tensor table, the copy into the arena, the commit.

The protocol (see proto/ckptd/v1/ckptd.proto and the Go client in
clients/go/ckptd): BeginSave with the tensor table leases a region of the
arena; the client copies each tensor straight into it; CommitSave returns
once the daemon has journaled the save. That copy is the whole stall a
trainer sees. A client that cannot map the arena streams the same bytes
(SaveStream).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from . import _copy, _copycheck, _limits, _names, _tensors
from ._arena import Arena
from ._errors import (
    AlreadyExistsError,
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    InvalidArgumentError,
    NotFoundError,
)
from ._handle import SaveHandle
from ._transport import Connection, LeaseLost, Outage
from .v1 import ckptd_pb2 as pb

# States of a save the daemon has accepted (journaled) and not given up on.
_ACCEPTED = frozenset(
    {pb.SAVE_STATE_STAGED, pb.SAVE_STATE_DRAINING, pb.SAVE_STATE_DURABLE, pb.SAVE_STATE_COMMITTED}
)


def metadata_bytes(metadata: Any) -> bytes:
    """The trainer's metadata as bytes, checked against the daemon's limit."""
    if isinstance(metadata, str):
        raise TypeError("metadata must be bytes, not str (encode it, e.g. metadata.encode())")
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"metadata must be bytes, not {type(metadata).__name__}")
    if len(metadata) > _limits.MAX_METADATA:
        raise InvalidArgumentError(
            f"metadata is {len(metadata)} bytes; at most {_limits.MAX_METADATA} fit in one request "
            "to the daemon (save large state as tensors instead)"
        )
    return bytes(metadata)


def target(job: str | None, step: int, rank: int, world_size: int, attempt: str) -> pb.SaveTarget:
    """Build the save target; range checks are the daemon's, so one rule holds."""
    step, rank, world_size = (
        _limits.as_int("step", step),
        _limits.as_int("rank", rank),
        _limits.as_int("world_size", world_size),
    )
    fields = (("step", step, _limits.INT64), ("rank", rank, _limits.INT32))
    for name, v, bounds in (*fields, ("world_size", world_size, _limits.INT32)):
        if not _limits.within(v, bounds):
            raise InvalidArgumentError(f"{name} {v} is out of range")
    return pb.SaveTarget(
        job=job or "", step=step, rank=rank, world_size=world_size, attempt=attempt
    )


def save(
    conn: Connection, target: pb.SaveTarget, state: Mapping[str, Any], meta: bytes
) -> SaveHandle:
    """Stage state as target's shard; return as soon as the daemon has journaled it.

    A daemon that goes away is waited for (conn's reconnect_timeout) and the
    save made again; see Client.save.
    """
    shard = _shard(target, state, meta)
    return _retrying(conn, shard, Outage(conn, shard.what), _Doubt())


def _retrying(conn: Connection, shard: _Shard, outage: Outage, doubt: _Doubt) -> SaveHandle:
    """Make shard's save, again from the start whenever the daemon went away meanwhile.

    outage bounds the whole by reconnect_timeout from its first failure (a
    caller may have had one already); doubt says whether a commit of this
    save may have reached the daemon unanswered.
    """
    target = shard.target
    while True:
        try:
            arena = conn.mapping(refresh=outage.active)
            if arena is None:
                resp = _save_stream(conn, shard, doubt)
            else:
                resp = _save_shm(conn, shard, doubt)
        except DaemonUnavailableError as e:
            outage.pause(e)
        except LeaseLost as e:
            outage.pause(e.error)
        except AlreadyExistsError as e:
            verdict = _saved_before(conn, e, target, doubt.sent, outage.active)
            if verdict == "raise":
                raise
            if verdict == "accepted":
                job_name = target.job or e.metadata.get("job", "")
                return SaveHandle(conn, job_name, target.step, target.rank, attempt=target.attempt)
            outage.pause(e)
        else:
            t = resp.target
            return SaveHandle(conn, t.job, t.step, t.rank, attempt=target.attempt)


class Held:
    """A shard copied into a leased region now and committed later (ckptd.dcp's rank 0).

    Its metadata is known only at the commit. Staging rides out a daemon
    that is away (or not up yet) as save() does, for reconnect_timeout. A
    lease lost before the commit (the daemon restarted, or the connection
    that held it ended) is made again through save()'s own loop, from what
    the caller's ``again`` gives (commit): the state's leaves when they
    cannot have changed since staging, else staged_leaves(), the region's
    bytes copied out, which are trusted only where nothing can have
    written over them (see staged_leaves). A client that streams (no arena
    mapping) keeps a private copy instead and saves it at the commit.
    """

    def __init__(self, conn: Connection, target: pb.SaveTarget, state: Mapping[str, Any]) -> None:
        self._conn = conn
        self.shard = _shard(target, state, b"")
        self._lease: pb.Lease | None = None
        self._arena: Arena | None = None  # the mapping the region is in
        self._region: np.ndarray | None = None
        self._private: list[_tensors.Leaf] | None = None
        self._check: _Check = ([], b"", [])  # of what was staged, when the daemon checks copies
        self._lost = False  # the lease failed at its commit
        outage = Outage(conn, self.shard.what)
        while True:
            try:
                arena = conn.mapping(refresh=outage.active)
                if arena is None:
                    self._private = [_copy_leaf(x) for x in self.shard.leaves]
                else:
                    staged = _stage(conn, self.shard)
                    self._lease, self._arena, self._region, self._check = staged
                return
            except DaemonUnavailableError as e:
                outage.pause(e)
            except AlreadyExistsError as e:
                # Nothing was committed: only our own lease from before an
                # outage, not released yet, is waited out.
                if _saved_before(conn, e, target, False, outage.active) != "retry":
                    raise
                outage.pause(e)

    @property
    def what(self) -> str:
        """Names the save in messages."""
        return self.shard.what

    def commit(
        self,
        meta: bytes,
        again: Callable[[], list[_tensors.Leaf]],
        extra: Sequence[_tensors.Leaf] = (),
    ) -> SaveHandle:
        """Commit the held region with meta and return the save's handle.

        When the lease is lost, or extra tensors are to be added to the
        shard (then the region cannot be committed as it is), the save is
        made again through save()'s loop, from again() and extra, within
        the same reconnect_timeout. again is called only then, once a
        daemon answers again.
        """
        conn, target = self._conn, self.shard.target
        outage = Outage(conn, self.what)
        doubt = _Doubt()
        lease = self._lease
        if lease is not None and not extra:
            try:
                resp = _commit(conn, lease, meta, self.what, doubt, self._check[2])
            except DaemonUnavailableError as e:
                self._lost = True
                outage.pause(e)
            except LeaseLost as e:
                self._lost = True
                outage.pause(e.error)
            except BaseException:
                self.abort()
                raise
            else:
                self._lease = None
                t = resp.target
                return SaveHandle(conn, t.job, t.step, t.rank, attempt=target.attempt)
        while True:
            try:
                conn.mapping(refresh=outage.active)  # the daemon's arena now, for again()
                if doubt.sent and _accepted(conn, target):
                    self._lease = None  # the lost answer's commit was journaled
                    t = target
                    return SaveHandle(conn, t.job, t.step, t.rank, attempt=t.attempt)
                leaves = self._private if self._private is not None else again()
                break
            except DaemonUnavailableError as e:
                outage.pause(e)
        self.abort()
        shard = _shard_of(target, [*leaves, *extra], meta)
        return _retrying(conn, shard, outage, doubt)

    def staged_leaves(self) -> list[_tensors.Leaf]:
        """The staged bytes, copied out of the region, for a save made again.

        For a caller whose tensors may have changed since staging. A region
        whose lease was lost is trusted only where nothing can have written
        over it since: the daemon that leased it still serves and sees this
        process (a lost lease's region is then kept until this process
        exits), or that daemon is gone and the arena file with it (a clean
        shutdown deletes it; a successor makes another, so only old clients
        still map the old one). A successor that reused the arena (after a
        crash) hands its space out again after --crash-fence.

        Raises:
            CkptdError: the region cannot be trusted; the save is not made.
        """
        if self._private is not None:
            return self._private
        region, arena, lease = self._region, self._arena, self._lease
        assert region is not None
        assert arena is not None
        assert lease is not None
        if self._lost and not self._region_kept(lease, arena):
            raise CkptdError(
                f"{self.what}: the staged copy was lost: the daemon restarted on the same "
                "arena (after a crash, or a shutdown that left saves in it) between the "
                "staging and the commit, and may have given that space to another save "
                "since, while this process's tensors have changed; the step cannot "
                "commit without this shard. Save a later step (dcp.save makes a lost "
                "copy again from the state itself)"
            )
        copies = [_copy_leaf(x, region) for x in self.shard.leaves]
        ends, key, hashes = self._check
        if hashes:
            _copycheck.check_copied(self.shard.leaves, copies, ends, key, hashes, self.what)
        return copies

    def _region_kept(self, lease: pb.Lease, arena: Arena) -> bool:
        conn = self._conn
        if lease.arena_id and lease.arena_id == conn.arena_id:
            return _sees_us(conn.ensure_trusted(self.what).pid)
        return not arena.is_current()

    def abort(self) -> None:
        """Give the region back (quietly, if the lease is gone already)."""
        if self._lease is not None:
            _abort(self._conn, self._lease.id)
            self._lease = None


def _sees_us(daemon_pid: int) -> bool:
    """Whether the daemon (its pid as we see it) is in this process's pid namespace.

    Then it can tell when this process exits, which is when it reuses the
    regions of this process's lost leases.
    """
    if daemon_pid <= 0:
        return False
    try:
        ours, theirs = os.stat("/proc/self/ns/pid"), os.stat(f"/proc/{daemon_pid}/ns/pid")
    except OSError:
        return False
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def _copy_leaf(leaf: _tensors.Leaf, region: np.ndarray | None = None) -> _tensors.Leaf:
    """A leaf holding a private copy of leaf's bytes: from its region when given, else its value."""
    buf = np.empty(leaf.nbytes, np.uint8)
    if region is None:
        _tensors.copy_in(leaf, buf, lambda: False)
    else:
        np.copyto(buf, region[leaf.offset : leaf.offset + leaf.nbytes])
    value = buf.view(leaf.dtype.raw).reshape(leaf.shape)
    return _tensors.Leaf(leaf.name, leaf.dtype, leaf.shape, value, "numpy")


@dataclass(frozen=True)
class _Shard:
    """What one save sends: its target, tensor table and leaves, and metadata."""

    target: pb.SaveTarget
    table: list[pb.Tensor]
    leaves: list[_tensors.Leaf]
    size: int  # bytes of the region the leaves are laid out in
    meta: bytes
    what: str  # names the save in messages


def _shard(target: pb.SaveTarget, state: Mapping[str, Any], meta: bytes) -> _Shard:
    """Lay state's leaves out as target's shard."""
    return _shard_of(target, [_tensors.make_leaf(n, v) for n, v in _flatten(state)], meta)


def _shard_of(target: pb.SaveTarget, leaves: list[_tensors.Leaf], meta: bytes) -> _Shard:
    """Lay leaves out as target's shard."""
    size = _tensors.layout(leaves)
    table = [
        pb.Tensor(name=x.name, dtype=x.dtype.name, shape=x.shape, offset=x.offset, length=x.nbytes)
        for x in leaves
    ]
    return _Shard(target, table, leaves, size, meta, f"save step {target.step} rank {target.rank}")


class _Doubt:
    """Whether a commit of a save was sent and its answer lost (see save)."""

    sent = False


def _saved_before(  # noqa: PLR0911 - one answer per case of the contract
    conn: Connection,
    err: AlreadyExistsError,
    target: pb.SaveTarget,
    in_doubt: bool,
    retrying: bool,
) -> Literal["accepted", "retry", "raise"]:
    """Decide about ALREADY_EXISTS for a save, which may be the answer to our own.

    in_doubt: a commit of this save was sent and its answer lost (the
    daemon went away), so the daemon may have journaled it and, after a
    restart, replayed it. Only then can the save it reports be ours.
    """
    meta = err.metadata
    if meta.get("attempt", target.attempt) != target.attempt:
        return "raise"  # another attempt's: never ours
    if err.reason == "SAVE_IN_PROGRESS":
        if meta.get("state", "").lower() == "staging":
            # A lease not committed yet: ours from before the outage, which
            # the daemon releases when it notices the connection is gone.
            return "retry" if retrying else "raise"
        return "accepted" if in_doubt else "raise"
    if err.reason == "STEP_COMMITTED":
        # Committed from this attempt's saves, ours among them.
        return "accepted" if in_doubt and "attempt" in meta else "raise"
    if err.reason is None and in_doubt:
        # A daemon without reasons: ask it about this very save.
        try:
            return "accepted" if _accepted(conn, target) else "raise"
        except DaemonUnavailableError:
            return "retry"  # gone again: start over, within the same bound
    return "raise"


def _accepted(conn: Connection, target: pb.SaveTarget) -> bool:
    """Whether the daemon has accepted target's save (of its attempt).

    Raises:
        DaemonUnavailableError: no daemon answered.
    """
    probe = pb.WaitSaveRequest(
        job=target.job, step=target.step, rank=target.rank, attempt=target.attempt, nowait=True
    )
    try:
        state = conn.call("WaitSave", probe, "look up the save").state
    except DaemonUnavailableError:
        raise
    except CkptdError:
        return False  # it knows of no such save
    return bool(state in _ACCEPTED)


_Check = tuple[list[int], bytes, list[int]]  # a copy check's chunk ends, key and client's MACs


def _stage(conn: Connection, shard: _Shard) -> tuple[pb.Lease, Arena, np.ndarray, _Check]:
    """Lease a region for shard and copy its leaves in; the region goes back if that fails.

    Returns the lease, the mapping its region is in, the region, and the
    copy check's ends, key and MACs of what was copied when the daemon checks
    copies (else none).
    """
    what, size = shard.what, shard.size
    begin = pb.BeginSaveRequest(target=shard.target, tensors=shard.table)
    resp = conn.call("BeginSave", begin, what)
    lease = resp.lease
    ends: list[int] = []
    key = b""
    hashes: list[int] = []
    try:
        if lease.length < size:
            raise CkptdError(f"{what}: daemon leased {lease.length} bytes for a {size}-byte table")
        arena = conn.lease_mapping(lease.arena_id)  # the lease says which arena it is in
        region = arena.region(lease.offset, size)
        if resp.HasField("copy_check"):
            ends, key = list(resp.copy_check.chunk_ends), bytes(resp.copy_check.key)
            hashes = _copycheck.copy_and_hash(
                shard.leaves,
                ends,
                key,
                region,
                lambda rest: _copy_leaves(rest, region, arena.pin),
            )
        else:
            _copy_leaves(shard.leaves, region, arena.pin)
    except BaseException:
        _abort(conn, lease.id)
        raise
    return lease, arena, region, (ends, key, hashes)


def _save_shm(conn: Connection, shard: _Shard, doubt: _Doubt) -> pb.CommitSaveResponse:
    lease, _, _, (_, _, hashes) = _stage(conn, shard)
    try:
        return _commit(conn, lease, shard.meta, shard.what, doubt, hashes)
    except BaseException:
        # Give the region back at once rather than after --lease-timeout.
        # (A failed commit leaves nothing to abort; this then fails quietly.)
        _abort(conn, lease.id)
        raise


def _commit(
    conn: Connection,
    lease: pb.Lease,
    meta: bytes,
    what: str,
    doubt: _Doubt,
    hashes: Sequence[int] = (),
) -> pb.CommitSaveResponse:
    """CommitSave; a lease the daemon no longer knows raises LeaseLost."""
    req = pb.CommitSaveRequest(lease_id=lease.id, metadata=meta, chunk_hashes=hashes)
    try:
        resp: pb.CommitSaveResponse = conn.call("CommitSave", req, what)
    except DaemonUnavailableError as e:
        # Without a reason nobody said no: it may have been journaled.
        doubt.sent = doubt.sent or e.reason is None
        raise
    except NotFoundError as e:
        if e.reason not in (None, "UNKNOWN_LEASE"):
            raise
        raise LeaseLost(e) from None  # it died with a daemon (or its connection)
    return resp


def _abort(conn: Connection, lease_id: str) -> None:
    with contextlib.suppress(grpc.RpcError, CkptdError):
        conn.ensure_trusted("abort a save")
        conn.stub.AbortSave(pb.AbortSaveRequest(lease_id=lease_id), timeout=5)


def _save_stream(conn: Connection, shard: _Shard, doubt: _Doubt) -> pb.CommitSaveResponse:
    what = shard.what
    header = pb.SaveStreamHeader(target=shard.target, tensors=shard.table, metadata=shard.meta)

    def messages() -> Iterator[pb.SaveStreamRequest]:
        yield pb.SaveStreamRequest(header=header)
        for piece in _stream_bytes(shard.leaves, shard.size):
            yield pb.SaveStreamRequest(data=piece)

    if conn.closed:
        raise ClientClosedError(f"{what}: the client is closed")
    conn.ensure_trusted(what)
    try:
        resp: pb.CommitSaveResponse = conn.stub.SaveStream(messages(), timeout=conn.timeout)
    except grpc.RpcError as e:
        err = conn.error(e, what)
        if isinstance(err, DaemonUnavailableError) and err.reason is None:
            doubt.sent = True  # the whole stream may have reached it
        raise err from None
    return resp


def _flatten(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Flatten state, reporting a bad structure as InvalidArgumentError."""
    try:
        yield from _names.flatten(state)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def _copy_leaves(leaves: list[_tensors.Leaf], region: np.ndarray, pin: Any) -> None:
    """Copy every leaf into its place in region, then wait for device copies."""
    devices = set()
    host = []
    for leaf in leaves:  # device copies first: they run on the DMA engine meanwhile
        if leaf.nbytes == 0:
            continue
        dst = region[leaf.offset : leaf.offset + leaf.nbytes]
        if not _tensors.on_device(leaf):
            host.append(_tensors.host_pair(leaf, dst))
        elif _tensors.copy_in(leaf, dst, pin):
            devices.add(leaf.value.device)
    _copy.copy(host)
    if devices:
        torch = _tensors.loaded_torch()
        for d in devices:
            torch.cuda.current_stream(d).synchronize()


def _stream_bytes(leaves: list[_tensors.Leaf], size: int) -> Iterator[bytes]:
    """The region's bytes as streamed: each tensor at its offset, gaps zeroed."""
    pos = 0
    for leaf in sorted(leaves, key=lambda x: x.offset):
        if leaf.nbytes == 0:
            continue
        if leaf.offset > pos:
            yield bytes(leaf.offset - pos)
        buf = np.empty(leaf.nbytes, np.uint8)
        _tensors.copy_in(leaf, buf, lambda: False)  # unpinned: a synchronous copy
        for i in range(0, buf.size, _limits.STREAM_CHUNK):
            yield buf[i : i + _limits.STREAM_CHUNK].tobytes()
        pos = leaf.offset + leaf.nbytes
    if size > pos:  # pragma: no cover - layout never ends in a gap
        yield bytes(size - pos)
