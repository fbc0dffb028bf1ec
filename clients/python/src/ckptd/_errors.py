"""Exception classes, and the mapping from gRPC status codes to them.

Callers should never have to import grpc to tell an unknown step from a full
arena, so every error the daemon reports becomes one of these classes, with
the daemon's own message kept verbatim.
"""

from __future__ import annotations

import builtins

import grpc


class CkptdError(Exception):
    """Base class of every error raised by the ckptd client.

    Attributes:
        code: the gRPC status code name (``"NOT_FOUND"``, ...) when the daemon
            reported the error, else ``None``.
        details: the daemon's message, verbatim.
    """

    def __init__(self, message: str, *, code: str | None = None, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class DaemonUnavailableError(CkptdError, ConnectionError):
    """No daemon answers on the socket, or it is shutting down."""


class StorageUnavailableError(CkptdError, ConnectionError):
    """The daemon could not reach its storage (or a dataset's source).

    The store did not answer, or kept failing with throttling or server
    errors, until the daemon's ``--s3-retry-deadline`` passed. The request
    itself was fine and may succeed later.
    """


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
        shard: the shard's object name as the daemon reported it, or None
            when the message did not name one. Pass skip_corrupt=True to
            dataset() to skip such shards (and count them) instead.
    """

    def __init__(
        self, message: str, *, shard: str | None, code: str | None = None, details: str = ""
    ) -> None:
        super().__init__(message, code=code, details=details)
        self.shard = shard


class TimeoutError(CkptdError, builtins.TimeoutError):
    """A deadline passed before the daemon answered (the save may still finish)."""


class SaveFailedError(CkptdError):
    """The daemon gave up on a save it had accepted."""


class ClientClosedError(CkptdError):
    """The client was closed."""


_BY_CODE: dict[grpc.StatusCode, type[CkptdError]] = {
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailableError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
}


def from_rpc_error(err: grpc.RpcError, socket: str, what: str) -> CkptdError:
    """Turn a failed call into the matching exception.

    ``what`` names the operation (``"save step 7 rank 0"``), so that the
    message says what failed and not only why.
    """
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else str(err)) or ""
    if code == grpc.StatusCode.CANCELLED and "closed" in details.lower():
        return ClientClosedError(f"{what}: the client is closed", code=code.name, details=details)
    cls = _BY_CODE.get(code, CkptdError)
    msg = f"{what}: {details}" if details else f"{what}: {code.name}"
    if cls is DaemonUnavailableError and _STORAGE_UNAVAILABLE in details:
        cls = StorageUnavailableError  # the daemon answered: its storage did not
    elif cls is DaemonUnavailableError and _is_connect_failure(details):
        msg = (
            f"{what}: no ckptd daemon answers on {socket} ({details}); "
            f"start one with `ckptd serve --socket {socket}` or set CKPTD_SOCKET"
        )
    return cls(msg, code=code.name, details=details)


# The daemon's words for an unreachable store (Go's storage.ErrUnavailable).
_STORAGE_UNAVAILABLE = "storage unavailable"


def _is_connect_failure(details: str) -> bool:
    """Tell "nobody listens" from "the daemon said it is shutting down"."""
    d = details.lower()
    return any(
        s in d
        for s in ("failed to connect", "no such file", "connection refused", "connect failed")
    )
