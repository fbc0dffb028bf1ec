"""Helpers of the error tests: failed gRPC calls built by hand, as the daemon sends them."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2


class FakeRpcError(grpc.RpcError, grpc.Call):
    """A failed call as grpc raises it: code, details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing

    def initial_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


def rpc_error(
    code: grpc.StatusCode,
    details: str,
    reason: str | None = None,
    metadata: dict[str, str] | None = None,
    *,
    domain: str = "ckptd.io",
    status_code: int | None = None,
    status_message: str | None = None,
) -> FakeRpcError:
    """A failed call; with reason, it carries a Status with one ErrorInfo."""
    if reason is None:
        return FakeRpcError(code, details)
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata or {}))
    status = status_pb2.Status(
        code=code.value[0] if status_code is None else status_code,
        message=details if status_message is None else status_message,
        details=[packed],
    )
    return FakeRpcError(code, details, (("grpc-status-details-bin", status.SerializeToString()),))
