"""The daemon's ErrorInfo reasons decide the exception class; the code is the fallback.

No daemon here: the failed calls are built by hand, carrying a
google.rpc.Status with an ErrorInfo the way the daemon sends it, and so
are WaitSave's answers for a save the daemon gave up on (reason and
metadata in the answer itself).
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2
from rpcerrors import FakeRpcError, rpc_error

import ckptd
from ckptd import _errors, _handle
from ckptd.v1 import ckptd_pb2 as pb

SOCK = "/run/ckptd.sock"

REASONS = [
    ("INVALID", grpc.StatusCode.INVALID_ARGUMENT, ckptd.InvalidArgumentError),
    ("STEP_NOT_FOUND", grpc.StatusCode.NOT_FOUND, ckptd.NotFoundError),
    ("UNKNOWN_LEASE", grpc.StatusCode.NOT_FOUND, ckptd.NotFoundError),
    ("UNKNOWN_SESSION", grpc.StatusCode.NOT_FOUND, ckptd.NotFoundError),
    ("STEP_COMMITTED", grpc.StatusCode.ALREADY_EXISTS, ckptd.AlreadyExistsError),
    ("SAVE_IN_PROGRESS", grpc.StatusCode.ALREADY_EXISTS, ckptd.AlreadyExistsError),
    ("ARENA_FULL", grpc.StatusCode.RESOURCE_EXHAUSTED, ckptd.ResourceExhaustedError),
    ("TOO_LARGE", grpc.StatusCode.RESOURCE_EXHAUSTED, ckptd.ResourceExhaustedError),
    ("OVER_BUDGET", grpc.StatusCode.RESOURCE_EXHAUSTED, ckptd.ResourceExhaustedError),
    ("STORAGE_FULL", grpc.StatusCode.RESOURCE_EXHAUSTED, ckptd.ResourceExhaustedError),
    ("CORRUPT", grpc.StatusCode.DATA_LOSS, ckptd.DataLossError),
    ("STORAGE_UNAVAILABLE", grpc.StatusCode.UNAVAILABLE, ckptd.StorageUnavailableError),
    ("SHUTTING_DOWN", grpc.StatusCode.UNAVAILABLE, ckptd.DaemonUnavailableError),
    ("PERMISSION_DENIED", grpc.StatusCode.PERMISSION_DENIED, ckptd.PermissionDeniedError),
    ("STORAGE_MISCONFIGURED", grpc.StatusCode.FAILED_PRECONDITION, ckptd.StorageMisconfiguredError),
    ("STORE_UNSAFE", grpc.StatusCode.FAILED_PRECONDITION, ckptd.StoreUnsafeError),
    ("DEADLINE", grpc.StatusCode.DEADLINE_EXCEEDED, ckptd.TimeoutError),
    ("CANCELLED", grpc.StatusCode.CANCELLED, ckptd.CkptdError),
    ("INTERNAL", grpc.StatusCode.INTERNAL, ckptd.CkptdError),
]


@pytest.mark.parametrize(("reason", "code", "cls"), REASONS)
def test_every_reason_of_the_contract_maps_to_its_class(reason, code, cls):
    err = _errors.from_rpc_error(
        rpc_error(code, "the daemon's words", reason, {"step": "7", "attempt": "a1"}), SOCK, "op"
    )
    assert type(err) is cls
    assert err.reason == reason
    assert err.metadata == {"step": "7", "attempt": "a1"}
    assert err.code == code.name
    assert err.details == "the daemon's words"
    assert str(err).startswith("op: the daemon's words")


def test_reason_decides_over_the_code_and_over_the_words():
    # UNAVAILABLE alone would mean "no daemon"; the reason says its storage is out.
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "s3 did not answer", "STORAGE_UNAVAILABLE"),
        SOCK,
        "load step 3",
    )
    assert isinstance(err, ckptd.StorageUnavailableError)
    assert "ckptd serve" not in str(err)  # the daemon answered: do not tell to start one
    # The words of the message never decide: "storage unavailable" without
    # the reason is a plain UNAVAILABLE.
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "storage unavailable: s3"), SOCK, "load step 3"
    )
    assert type(err) is ckptd.DaemonUnavailableError
    assert err.reason is None and err.metadata == {}


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, ckptd.InvalidArgumentError),
        (grpc.StatusCode.OUT_OF_RANGE, ckptd.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, ckptd.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, ckptd.AlreadyExistsError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ckptd.ResourceExhaustedError),
        (grpc.StatusCode.DATA_LOSS, ckptd.DataLossError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ckptd.TimeoutError),
        (grpc.StatusCode.PERMISSION_DENIED, ckptd.PermissionDeniedError),
        (grpc.StatusCode.UNAVAILABLE, ckptd.DaemonUnavailableError),
        (grpc.StatusCode.INTERNAL, ckptd.CkptdError),
        (grpc.StatusCode.UNKNOWN, ckptd.CkptdError),
    ],
)
def test_without_error_info_the_code_decides(code, cls):
    err = _errors.from_rpc_error(rpc_error(code, "why"), SOCK, "op")
    assert type(err) is cls
    assert err.reason is None


def test_no_daemon_message_names_the_socket_and_the_fix():
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), SOCK, "list"
    )
    assert SOCK in str(err) and f"ckptd serve --socket {SOCK}" in str(err)


@pytest.mark.parametrize(
    "kw",
    [
        {"domain": "example.com"},  # another service's reason is not the daemon's
        {"status_code": code_pb2.NOT_FOUND},  # the Status disagrees with the call's code
        {"status_message": "other words"},  # ... or with its message
    ],
)
def test_unusable_error_info_falls_back_to_the_code(kw):
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.ALREADY_EXISTS, "exists", "SAVE_IN_PROGRESS", **kw), SOCK, "op"
    )
    assert type(err) is ckptd.AlreadyExistsError
    assert err.reason is None


def test_unknown_reason_falls_back_to_the_code():
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.NOT_FOUND, "gone", "SOMETHING_NEW", {"x": "1"}), SOCK, "op"
    )
    assert type(err) is ckptd.NotFoundError
    assert err.reason == "SOMETHING_NEW" and err.metadata == {"x": "1"}


def test_garbage_status_details_fall_back_to_the_code():
    err = _errors.from_rpc_error(
        FakeRpcError(
            grpc.StatusCode.DATA_LOSS, "bad", (("grpc-status-details-bin", b"\xff\xff\xff"),)
        ),
        SOCK,
        "op",
    )
    assert type(err) is ckptd.DataLossError and err.reason is None


def test_corrupt_shard_is_named_by_the_metadata():
    from ckptd import _dataset

    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.DATA_LOSS, "bad tar", "CORRUPT", {"shard": "train-0003.tar"}),
        SOCK,
        "next batch",
    )
    shard_err = _dataset._corrupt_shard(err)
    assert isinstance(shard_err, ckptd.CorruptShardError)
    assert shard_err.shard == "train-0003.tar" and shard_err.reason == "CORRUPT"
    # A corrupt checkpoint chunk (no shard) stays a plain DataLossError.
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.DATA_LOSS, "chunk 3 hash", "CORRUPT", {"chunk": "3"}), SOCK, "op"
    )
    assert type(_dataset._corrupt_shard(err)) is ckptd.DataLossError


def test_corrupt_shard_is_never_read_from_the_message():
    from ckptd import _dataset

    # Without ErrorInfo the words "corrupt shard: NAME:" decide nothing.
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.DATA_LOSS, "corrupt shard: train-0003.tar: bad header"),
        SOCK,
        "op",
    )
    assert type(_dataset._corrupt_shard(err)) is ckptd.DataLossError
    # A shard in the metadata of another reason is not a corrupt shard either.
    err = _errors.from_rpc_error(
        rpc_error(grpc.StatusCode.NOT_FOUND, "gone", "STEP_NOT_FOUND", {"shard": "a.tar"}),
        SOCK,
        "op",
    )
    assert type(_dataset._corrupt_shard(err)) is ckptd.NotFoundError


# ---- a save the daemon gave up on after accepting it (WaitSave's answer) --------


WHAT = "save of job 'j' step 7 rank 0"
WORDS = "step 7 of job j is already committed by another attempt (new-run)"


def test_save_refused_late_raises_what_a_save_refused_at_once_raises():
    late = _handle.failure(
        WHAT,
        pb.WaitSaveResponse(
            state=pb.SAVE_STATE_FAILED,
            error=WORDS,
            reason="STEP_COMMITTED",
            metadata={"job": "j", "step": "7", "attempt": "new-run"},
        ),
    )
    at_once = _errors.from_rpc_error(
        rpc_error(
            grpc.StatusCode.ALREADY_EXISTS,
            WORDS,
            "STEP_COMMITTED",
            {"job": "j", "step": "7", "attempt": "new-run"},
        ),
        SOCK,
        WHAT,
    )
    assert type(late) is type(at_once) is ckptd.AlreadyExistsError
    assert str(late) == str(at_once) == f"{WHAT}: {WORDS}"
    assert late.reason == "STEP_COMMITTED" and late.details == WORDS
    assert late.metadata == at_once.metadata
    assert late.metadata["attempt"] == "new-run"  # who committed the step


def test_save_failed_without_a_reason_is_save_failed_error():
    # An older daemon: no reason, as before.
    err = _handle.failure(WHAT, pb.WaitSaveResponse(state=pb.SAVE_STATE_FAILED, error="why"))
    assert type(err) is ckptd.SaveFailedError
    assert str(err) == f"{WHAT} failed (failed): why"
    assert err.reason is None and err.metadata == {}


@pytest.mark.parametrize(
    ("reason", "cls"),
    [
        ("STORAGE_FULL", ckptd.ResourceExhaustedError),
        ("CORRUPT", ckptd.DataLossError),
        ("STORAGE_UNAVAILABLE", ckptd.StorageUnavailableError),
        # Those that would say "not known yet, wait again": the answer is final.
        ("SHUTTING_DOWN", ckptd.SaveFailedError),
        ("DEADLINE", ckptd.SaveFailedError),
        # No class more telling than SaveFailedError.
        ("INTERNAL", ckptd.SaveFailedError),
        ("SOMETHING_NEW", ckptd.SaveFailedError),
    ],
)
def test_save_failed_with_a_reason_raises_its_class(reason, cls):
    r = pb.WaitSaveResponse(
        state=pb.SAVE_STATE_FAILED, error="why", reason=reason, metadata={"x": "1"}
    )
    err = _handle.failure(WHAT, r)
    assert type(err) is cls
    assert str(err) == f"{WHAT}: why"
    assert err.reason == reason and err.metadata == {"x": "1"}


@pytest.mark.parametrize(
    "state", [pb.SAVE_STATE_COMMITTED, pb.SAVE_STATE_HOT, pb.SAVE_STATE_REPLICATED]
)
def test_save_that_ended_well_is_no_error(state):
    assert _handle.failure(WHAT, pb.WaitSaveResponse(state=state)) is None


def test_every_reason_of_the_proto_has_a_class_and_a_row_here():
    """The proto's ErrorReason is the one list: a reason added there fails
    here until the client maps it and this table covers it."""
    names = {pb.ErrorReason.Name(v) for v in pb.ErrorReason.values()} - {"ERROR_REASON_UNSPECIFIED"}
    assert names == set(_errors._BY_REASON)
    assert names == {r for r, _, _ in REASONS}
