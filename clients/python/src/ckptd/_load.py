"""Loading one rank's shard of a committed step, and listing the committed steps.

BeginRestore fills a region of the arena with the verified shard; the
client copies its tensors out (straight to a GPU when asked) and releases
the region before load returns, so nothing the caller keeps aliases shared
memory. A client that cannot map the arena streams the bytes instead
(RestoreStream).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from . import _copy, _copycheck, _kinds, _limits, _names, _tensors
from ._arena import Arena
from ._errors import (
    CkptdError,
    ClientClosedError,
    DaemonUnavailableError,
    InvalidArgumentError,
    NotFoundError,
)
from ._transport import Connection, LeaseLost, NotInPlace, Outage
from .v1 import ckptd_pb2 as pb

_LOG = logging.getLogger("ckptd")
_T = TypeVar("_T")


@dataclass(frozen=True)
class StepInfo:
    """A committed step."""

    step: int
    world_size: int
    bytes: int  # tensor bytes over all ranks
    stored_bytes: int  # bytes in storage, after compression
    committed_at: _dt.datetime
    attempt: str = ""  # the attempt whose ranks it holds ("" from an older daemon or step)


class LoadedState(dict):  # type: ignore[type-arg]
    """The state dict a load returns, with the shard's step and metadata.

    It is a plain dict (nested as saved) plus these attributes, so code
    that only wants the tensors can ignore them.
    """

    step: int
    world_size: int
    metadata: bytes
    attempt: str  # the attempt that wrote the step ("" from an older daemon or step)
    # Where the daemon found it: "hot" (the node's memory), "peer" (another
    # node's replica) or "storage" ("" from an older daemon).
    tier: str
    # For "latest": a newer step kept in memory only (ckptd serve
    # --persist-every) that could not be restored whole because nodes
    # holding some of its ranks were lost; 0 when none.
    skipped_step: int
    # For "latest" with finite=True: the newer committed steps passed over
    # because their tensors hold NaN or Inf, newest first.
    skipped_nonfinite: list[int]


def restore_request(
    step: int | str,
    rank: int,
    job: str | None,
    tensors: Sequence[str] | None = None,
    finite: bool = False,
    *,
    slices: Sequence[tuple[str, int, int]] = (),
    header_only: bool = False,
) -> pb.BeginRestoreRequest:
    """The BeginRestore request; range checks beyond the protocol's are the daemon's.

    step is an int or "latest"; tensors, when given, the stored names to
    restore (only their chunks are read); slices, instead, byte ranges of
    them, (name, offset, length) each; header_only restores none (the
    header, for its metadata); finite, with "latest", the newest
    committed step whose tensors hold no NaN or Inf.
    """
    if isinstance(tensors, str):
        raise TypeError("tensors must be a sequence of names, not a str")
    latest = isinstance(step, str)
    if latest and step != "latest":
        raise ValueError(f'step must be an int or "latest", not {step!r}')
    if step is None:
        raise TypeError('step must be an int or "latest", not None')
    if finite and not latest:
        raise ValueError('finite=True picks among steps for "latest": give step="latest"')
    rank = _limits.as_int("rank", rank)
    step = 0 if latest else _limits.as_int("step", step)
    if not _limits.within(rank, _limits.INT32) or not _limits.within(step, _limits.INT64):
        raise InvalidArgumentError(f"step {step} or rank {rank} is out of range")
    return pb.BeginRestoreRequest(
        job=job or "",
        step=step,
        latest=latest,
        rank=rank,
        tensors=list(tensors or ()),
        finite=finite,
        slices=[pb.TensorSlice(name=n, offset=o, length=k) for n, o, k in slices],
        header_only=header_only,
    )


def load(
    conn: Connection,
    req: pb.BeginRestoreRequest,
    what: str,
    as_torch: bool | None,
    device: Any,
    nested: bool,
    into: Mapping[str, Any] | None = None,
) -> LoadedState:
    """Restore req's shard; see Client.load.

    A daemon that goes away is waited for (conn's reconnect_timeout), and
    a load whose region may have been handed on meanwhile is made again.
    """
    out = _Outputs(True if device is not None else as_torch, device, into)

    def build(header: pb.RestoreHeader, data: np.ndarray, arena: Arena | None) -> Any:
        if arena is not None and out.needs_pin:
            out.pinned = arena.pin()
        return out.build(header, data)

    # Loads into CUDA copy from pinned memory, which the arena is and the
    # hot tier's read-only file cannot be.
    header, items = restore(conn, req, what, build, in_place=not out.needs_pin)
    result = LoadedState(_names.unflatten(items) if nested else dict(items))
    result.step, result.world_size, result.metadata, result.attempt = (
        header.step,
        header.world_size,
        header.metadata,
        header.attempt,
    )
    result.tier, result.skipped_step = header.tier, header.skipped_step
    result.skipped_nonfinite = list(header.skipped_nonfinite)
    if result.skipped_nonfinite:
        _LOG.warning(
            "ckptd: %s: passed over steps %s, whose tensors hold NaN or Inf; restored step %d",
            what,
            result.skipped_nonfinite,
            header.step,
        )
    if header.skipped_step:
        _LOG.warning(
            "ckptd: %s: step %d was kept in memory only and some of its ranks were lost "
            "with their nodes; restored step %d, the newest whole one",
            what,
            header.skipped_step,
            header.step,
        )
    return result


def restore(
    conn: Connection,
    req: pb.BeginRestoreRequest,
    what: str,
    use: Callable[[pb.RestoreHeader, np.ndarray, Arena | None], _T],
    in_place: bool = True,
) -> tuple[pb.RestoreHeader, _T]:
    """Restore req's shard (or its tensors) and return use(header, data, arena) on the bytes.

    data is the restored region of the arena (arena: its mapping), held
    only while use runs: use copies out what it keeps. A client that
    streams gets the bytes in memory (arena None). A daemon that goes away
    is waited for (conn's reconnect_timeout), and a restore whose region
    may have been handed on while use copied it is made again: use may run
    more than once, each time on all of the bytes.

    With in_place, a restore from the daemon's hot tier may hand out the
    hot copy itself, read-only (header.in_place): data is then the span of
    the shard that holds the tensors, and the table says where each is.
    """
    outage = Outage(conn, what)
    while True:
        try:
            arena = conn.mapping(refresh=outage.active)
            if arena is None:
                return _load_stream(conn, req, use, what)
            req.in_place = in_place and conn.in_place
            return _load_shm(conn, req, use, what)
        except DaemonUnavailableError as e:
            outage.pause(e)
        except LeaseLost as e:
            outage.pause(e.error)
        except NotInPlace:
            pass  # conn.in_place is off now: the next try is copied


def _load_shm(
    conn: Connection,
    req: pb.BeginRestoreRequest,
    use: Callable[[pb.RestoreHeader, np.ndarray, Arena | None], _T],
    what: str,
) -> tuple[pb.RestoreHeader, _T]:
    resp = conn.call("BeginRestore", req, what)
    release = pb.ReleaseRegionRequest(lease_id=resp.lease.id)
    header = resp.header
    private: np.ndarray | None = None
    try:
        arena = conn.lease_mapping(resp.lease.arena_id)
        region = arena.region(resp.lease.offset, header.size)
        if header.HasField("copy_check"):
            # Others can write the arena: use a copy of the region that is
            # ours alone, once it hashes as the daemon says.
            private = np.empty(header.size, np.uint8)
            _copy.copy([(private, region)])
        else:
            result = use(header, region, arena)
    except BaseException:
        # On failure the daemon reclaims the region after --lease-timeout.
        with contextlib.suppress(CkptdError):
            conn.call("ReleaseRegion", release, what)
        raise
    # The copies are good only if the region stayed ours while they were
    # made: a daemon that went away meanwhile may have handed it on.
    try:
        conn.call("ReleaseRegion", release, what)
    except NotFoundError as e:
        if e.reason not in (None, "UNKNOWN_LEASE"):
            raise
        raise LeaseLost(e) from None
    if private is not None:
        _copycheck.check_restored(header.copy_check, private, what)
        result = use(header, private, None)
    return header, result


def _load_stream(
    conn: Connection,
    req: pb.BeginRestoreRequest,
    use: Callable[[pb.RestoreHeader, np.ndarray, Arena | None], _T],
    what: str,
) -> tuple[pb.RestoreHeader, _T]:
    if conn.closed:
        raise ClientClosedError(f"{what}: the client is closed")
    conn.ensure_trusted(what)
    try:
        stream = conn.stub.RestoreStream(req, timeout=conn.timeout)
        first = next(stream, None)
        if first is None or not first.HasField("header"):
            raise CkptdError(f"{what}: the daemon's stream did not start with a header")
        header = first.header
        data = np.empty(header.size, np.uint8)
        n = 0
        for msg in stream:
            piece = np.frombuffer(msg.data, np.uint8)
            if n + piece.size > data.size:
                raise CkptdError(
                    f"{what}: the daemon streamed more than the {data.size} bytes announced"
                )
            data[n : n + piece.size] = piece
            n += piece.size
    except grpc.RpcError as e:
        raise conn.error(e, what) from None
    if n != data.size:
        raise CkptdError(f"{what}: the stream ended after {n} of {data.size} bytes")
    if header.HasField("copy_check"):  # the daemon streamed them out of its shared arena
        _copycheck.check_restored(header.copy_check, data, what)
    return header, use(header, data, None)


def steps(conn: Connection, job: str | None) -> list[StepInfo]:
    """The committed steps of job, oldest first; see Client.steps."""
    req = pb.ListStepsRequest(job=job or "")
    outage = Outage(conn, "list steps")
    while True:
        try:
            resp = conn.call("ListSteps", req, "list steps")
            break
        except DaemonUnavailableError as e:
            outage.pause(e)
    return [
        StepInfo(
            step=s.step,
            world_size=s.world_size,
            bytes=s.bytes,
            stored_bytes=s.stored_bytes,
            committed_at=_dt.datetime.fromtimestamp(
                s.committed_unix_nano / 1e9, tz=_dt.timezone.utc
            ),
            attempt=s.attempt,
        )
        for s in resp.steps
    ]


class _Outputs:
    """Builds the restored tensors in the form load was asked for.

    as_torch True: torch tensors; False: numpy arrays (torch for the dtypes
    numpy lacks); None: each as it was saved (the shard's ckptd.as record,
    see _kinds; numpy without one).
    """

    def __init__(
        self, as_torch: bool | None, device: Any, into: Mapping[str, Any] | None = None
    ) -> None:
        self.as_torch = as_torch
        self.torch = _tensors.torch_module() if as_torch else None
        if as_torch and self.torch is None:
            raise ImportError("load(as_torch=True) or load(device=...) needs torch installed")
        self.device = self.torch.device(device or "cpu") if self.torch is not None else None
        self.into = dict(into or {})
        # The CUDA devices of into's tensors: copies to them from pinned
        # memory are asynchronous, and waited for before the region goes.
        self.into_devices = {t.device for t in self.into.values() if getattr(t, "is_cuda", False)}
        self.needs_pin = bool(self.into_devices) or (
            self.device is not None and self.device.type == "cuda"
        )
        self.pinned = False

    def _kinds(self, header: pb.RestoreHeader) -> tuple[bool, set[str]]:
        """(torch by default, the stored names of the other kind) for header's tensors."""
        if self.as_torch is not None:
            return self.as_torch, set()
        default, others = _kinds.split([t.name for t in header.tensors])
        if default is None:
            return False, set()
        if self.torch is None and (default or others):
            self.torch = _tensors.torch_module()  # saved from torch: give torch back
            if self.torch is None:  # not installed here: numpy, as without a record
                return False, set()
            self.device = self.torch.device("cpu")
        return default, others

    def build(self, header: pb.RestoreHeader, data: np.ndarray) -> list[tuple[str, Any]]:
        items = []
        later: list[_copy.Pair] = []  # host copies, made together on a few threads
        default, others = self._kinds(header)
        for t in header.tensors:
            if _kinds.is_record(t.name):
                continue  # ckptd's own record of the kinds, not the caller's state
            dt = _tensors.BY_NAME.get(t.dtype)
            if dt is None:
                raise CkptdError(f"tensor {t.name!r} has dtype {t.dtype}, unknown to this client")
            if t.offset + t.length > data.size:
                raise CkptdError(f"tensor {t.name!r} lies outside the restored region")
            src = data[t.offset : t.offset + t.length]
            shape = tuple(t.shape)
            dest = self.into.get(t.name)
            if dest is not None and _tensors.into_out(
                sys.modules.get("torch"), dt, shape, src, dest, self.pinned, later
            ):
                items.append((t.name, dest))
            elif self.torch is None or default == (t.name in others):
                items.append((t.name, _tensors.default_out(dt, shape, src, later)))
            else:
                out = _tensors.torch_out(
                    self.torch, dt, shape, src, self.device, self.pinned, later
                )
                items.append((t.name, out))
        _copy.copy(later)
        if self.pinned:
            torch = _tensors.loaded_torch()
            devices = set(self.into_devices)
            if self.device is not None and self.device.type == "cuda":
                devices.add(self.device)
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
        return items
