"""Exception classes, and the mapping from the daemon's error statuses to them.

Callers should never have to import grpc to tell an unknown step from a full
arena, so every error the daemon reports becomes one of these classes, with
the daemon's own message kept verbatim. The daemon attaches a
``google.rpc.ErrorInfo`` (domain ``ckptd.io``) to its errors; its ``reason``
decides the class. A daemon that sends none is mapped by the status code
alone -- never by the words of its message.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import sys
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from .v1 import ckptd_pb2 as pb

# ErrorInfo.domain of the daemon's errors (contracts: structured errors).
DOMAIN = "ckptd.io"


class CkptdError(Exception):
    """Base class of every error raised by the ckptd client.

    Attributes:
        code: the gRPC status code name (``"NOT_FOUND"``, ...) when the daemon
            reported the error, else ``None``.
        details: the daemon's message, verbatim.
        reason: the daemon's ErrorInfo reason (``"STEP_COMMITTED"``, ...),
            or ``None`` when it sent none (an older daemon, or an error
            raised by the client itself).
        metadata: the ErrorInfo's metadata (``job``, ``step``, ``rank``,
            ``attempt``, ...); empty without one.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        details: str = "",
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.details = details
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class DaemonUnavailableError(CkptdError, ConnectionError):
    """No daemon answers on the socket, or it is shutting down.

    Client calls wait up to the client's reconnect_timeout for a daemon to
    answer again before raising it.
    """


class UntrustedDaemonError(CkptdError):
    """The socket, its folder, the process behind it or its arena is not trusted.

    Raised before anything is sent to the daemon or copied into its arena.
    The message names the path, the owner found and the fix.
    """


class PermissionDeniedError(CkptdError):
    """This client may not use the daemon.

    Either the daemon refused it (its uid is neither the daemon's, root's
    nor a member of the daemon's ``--socket-group``), or the socket, or a
    folder on the way to it, does not let this user in. The message names
    the socket or folder, its owner, group and mode, and the fix.
    """


class StorageUnavailableError(CkptdError, ConnectionError):
    """The daemon could not reach its storage (or a dataset's source).

    The store did not answer, or kept failing with throttling or server
    errors, until the daemon's ``--s3-retry-deadline`` passed. The request
    itself was fine and may succeed later.
    """


class StorageMisconfiguredError(CkptdError):
    """The daemon's storage refuses its credentials, or its bucket is missing.

    The daemon's configuration (credentials, bucket, endpoint) needs fixing,
    not the request: retrying will not help.
    """


class StoreUnsafeError(CkptdError):
    """The daemon refused to use its store: a symbolic link below the store's root."""


class InvalidArgumentError(CkptdError, ValueError):
    """The request was malformed; nothing was changed."""


class NotFoundError(CkptdError, LookupError):
    """The step (or rank, or lease) does not exist or is not committed."""


class AlreadyExistsError(CkptdError):
    """The step is already committed, or this rank is already being saved."""


class ResourceExhaustedError(CkptdError):
    """The daemon ran out of room.

    The staging arena stayed full past the daemon's --staging-wait, the
    request is larger than the whole arena, or storage is out of space.
    """


class DataLossError(CkptdError):
    """Stored data failed verification (a corrupt or truncated object)."""


class CorruptShardError(DataLossError):
    """A dataset shard could not be parsed (a truncated or corrupt tar).

    Attributes:
        shard: the shard's object name, from the ``shard`` metadata of the
            daemon's ErrorInfo (reason ``CORRUPT``); a daemon that sends no
            ErrorInfo raises a plain DataLossError instead. Pass
            skip_corrupt=True to dataset() to skip such shards (and count
            them) instead.
    """

    def __init__(self, message: str, *, shard: str | None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.shard = shard


if sys.version_info >= (3, 11):  # concurrent.futures.TimeoutError is the builtin

    class TimeoutError(CkptdError, builtins.TimeoutError):
        """A deadline passed before the daemon answered (the save may still finish).

        Also the builtin TimeoutError and concurrent.futures.TimeoutError
        (what SaveHandle.result(timeout) raises, as a Future would).
        """

else:

    class TimeoutError(CkptdError, builtins.TimeoutError, concurrent.futures.TimeoutError):
        """A deadline passed before the daemon answered (the save may still finish).

        Also the builtin TimeoutError and concurrent.futures.TimeoutError
        (what SaveHandle.result(timeout) raises, as a Future would).
        """


class SaveFailedError(CkptdError):
    """The daemon gave up on a save it had accepted.

    Raised when the daemon gave no reason (an older daemon) or one this
    client has no more specific class for; a reason that has one raises
    that class instead (see SaveHandle.wait).
    """


class ClientClosedError(CkptdError):
    """The client was closed."""


class NotReplicatedWarning(UserWarning):
    """A save kept in memory only reached this node's memory, not its peers.

    Warned by SaveHandle.wait when the daemon (``--persist-every`` with
    ``--peers``) could not send the save to its ``--replicas`` peers: the
    save stands (status HOT) but is lost with the node. The message says
    why.
    """


# The daemon's reasons (the proto's ErrorReason, whose names ErrorInfo
# carries: contracts, structured errors) and their classes.
_R = pb.ErrorReason
_CLASSES: dict[pb.ErrorReason, type[CkptdError]] = {
    _R.INVALID: InvalidArgumentError,
    _R.STEP_NOT_FOUND: NotFoundError,
    _R.UNKNOWN_LEASE: NotFoundError,
    _R.UNKNOWN_SESSION: NotFoundError,
    _R.STEP_COMMITTED: AlreadyExistsError,
    _R.SAVE_IN_PROGRESS: AlreadyExistsError,
    _R.ARENA_FULL: ResourceExhaustedError,
    _R.TOO_LARGE: ResourceExhaustedError,
    _R.OVER_BUDGET: ResourceExhaustedError,
    _R.STORAGE_FULL: ResourceExhaustedError,
    _R.CORRUPT: DataLossError,
    _R.STORAGE_UNAVAILABLE: StorageUnavailableError,
    _R.SHUTTING_DOWN: DaemonUnavailableError,
    _R.PERMISSION_DENIED: PermissionDeniedError,
    _R.STORAGE_MISCONFIGURED: StorageMisconfiguredError,
    _R.STORE_UNSAFE: StoreUnsafeError,
    _R.DEADLINE: TimeoutError,
    _R.CANCELLED: CkptdError,
    _R.INTERNAL: CkptdError,
}
_BY_REASON: dict[str, type[CkptdError]] = {_R.Name(r): cls for r, cls in _CLASSES.items()}

# For a status without ErrorInfo (or with a reason this client does not
# know): the class its code implies. UNAVAILABLE without a reason is taken
# for "no daemon" (the client waits for one): it cannot be told from a
# daemon's own UNAVAILABLE without reading the message.
_BY_CODE: dict[grpc.StatusCode, type[CkptdError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def error_info(err: Any) -> error_details_pb2.ErrorInfo | None:
    """The daemon's ErrorInfo carried by a failed call, or None.

    A status whose details cannot be read, or that disagrees with the call's
    code or message, counts as carrying none: the code still maps it.
    """
    try:
        status = rpc_status.from_call(err)
    except (ValueError, DecodeError, AttributeError, TypeError):
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                return info
    return None


def _code(err: Any) -> grpc.StatusCode:
    try:
        code = err.code()
    except (AttributeError, TypeError):
        return grpc.StatusCode.UNKNOWN
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _details(err: Any) -> str:
    try:
        return err.details() or ""
    except (AttributeError, TypeError):
        return str(err)


def from_reason(
    what: str,
    reason: str,
    details: str,
    metadata: Mapping[str, str],
    *,
    default: type[CkptdError],
) -> CkptdError:
    """The exception for a failure the daemon reported in an answer, not as a failed call.

    The class and message are those of a failed call with the same reason
    (``"{what}: {details}"``), so a save another run's commit refused late
    raises what one refused at once does. A reason without a class of its
    own, or one whose class means that the outcome is not known yet (no
    daemon answered, a deadline passed), gives default: the answer *is*
    the outcome, and a caller that waits again on those would loop forever.
    """
    cls = _BY_REASON.get(reason, default)
    if cls is CkptdError or issubclass(cls, (DaemonUnavailableError, TimeoutError)):
        cls = default
    return cls(
        f"{what}: {details}" if details else f"{what}: {reason}",
        details=details,
        reason=reason,
        metadata=metadata,
    )


def from_rpc_error(err: grpc.RpcError, socket: str, what: str) -> CkptdError:
    """Turn a failed call into the matching exception.

    ``what`` names the operation (``"save step 7 rank 0"``), so that the
    message says what failed and not only why. The class comes from the
    ErrorInfo reason when the daemon sent one, else from the status code.
    """
    code = _code(err)
    details = _details(err)
    info = error_info(err)
    reason = info.reason if info is not None else None
    cls = _BY_REASON.get(reason or "") or _BY_CODE.get(code, CkptdError)
    kw: dict[str, Any] = {
        "code": code.name,
        "details": details,
        "reason": reason,
        "metadata": dict(info.metadata) if info is not None else None,
    }
    if cls is DaemonUnavailableError and reason is None:
        # Nobody answered (no daemon, a crashed one), or a daemon too old to
        # say why: either way the socket is what the caller should check.
        msg = (
            f"{what}: no ckptd daemon answers on {socket} ({details or code.name}); "
            f"start one with `ckptd serve --socket {socket}` or set CKPTD_SOCKET"
        )
        return cls(msg, **kw)
    return cls(f"{what}: {details}" if details else f"{what}: {code.name}", **kw)
