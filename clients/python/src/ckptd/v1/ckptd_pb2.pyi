from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    INVALID: _ClassVar[ErrorReason]
    STEP_NOT_FOUND: _ClassVar[ErrorReason]
    UNKNOWN_LEASE: _ClassVar[ErrorReason]
    UNKNOWN_SESSION: _ClassVar[ErrorReason]
    STEP_COMMITTED: _ClassVar[ErrorReason]
    SAVE_IN_PROGRESS: _ClassVar[ErrorReason]
    ARENA_FULL: _ClassVar[ErrorReason]
    TOO_LARGE: _ClassVar[ErrorReason]
    OVER_BUDGET: _ClassVar[ErrorReason]
    STORAGE_FULL: _ClassVar[ErrorReason]
    CORRUPT: _ClassVar[ErrorReason]
    STORAGE_UNAVAILABLE: _ClassVar[ErrorReason]
    SHUTTING_DOWN: _ClassVar[ErrorReason]
    PERMISSION_DENIED: _ClassVar[ErrorReason]
    STORAGE_MISCONFIGURED: _ClassVar[ErrorReason]
    STORE_UNSAFE: _ClassVar[ErrorReason]
    DEADLINE: _ClassVar[ErrorReason]
    CANCELLED: _ClassVar[ErrorReason]
    INTERNAL: _ClassVar[ErrorReason]

class SaveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_STATE_UNSPECIFIED: _ClassVar[SaveState]
    SAVE_STATE_STAGED: _ClassVar[SaveState]
    SAVE_STATE_DRAINING: _ClassVar[SaveState]
    SAVE_STATE_DURABLE: _ClassVar[SaveState]
    SAVE_STATE_COMMITTED: _ClassVar[SaveState]
    SAVE_STATE_FAILED: _ClassVar[SaveState]
    SAVE_STATE_HOT: _ClassVar[SaveState]
    SAVE_STATE_REPLICATED: _ClassVar[SaveState]
ERROR_REASON_UNSPECIFIED: ErrorReason
INVALID: ErrorReason
STEP_NOT_FOUND: ErrorReason
UNKNOWN_LEASE: ErrorReason
UNKNOWN_SESSION: ErrorReason
STEP_COMMITTED: ErrorReason
SAVE_IN_PROGRESS: ErrorReason
ARENA_FULL: ErrorReason
TOO_LARGE: ErrorReason
OVER_BUDGET: ErrorReason
STORAGE_FULL: ErrorReason
CORRUPT: ErrorReason
STORAGE_UNAVAILABLE: ErrorReason
SHUTTING_DOWN: ErrorReason
PERMISSION_DENIED: ErrorReason
STORAGE_MISCONFIGURED: ErrorReason
STORE_UNSAFE: ErrorReason
DEADLINE: ErrorReason
CANCELLED: ErrorReason
INTERNAL: ErrorReason
SAVE_STATE_UNSPECIFIED: SaveState
SAVE_STATE_STAGED: SaveState
SAVE_STATE_DRAINING: SaveState
SAVE_STATE_DURABLE: SaveState
SAVE_STATE_COMMITTED: SaveState
SAVE_STATE_FAILED: SaveState
SAVE_STATE_HOT: SaveState
SAVE_STATE_REPLICATED: SaveState

class GetArenaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("path", "size", "locked", "default_job", "id", "hot")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JOB_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    HOT_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    locked: bool
    default_job: str
    id: str
    hot: MappedFile
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., locked: _Optional[bool] = ..., default_job: _Optional[str] = ..., id: _Optional[str] = ..., hot: _Optional[_Union[MappedFile, _Mapping]] = ...) -> None: ...

class MappedFile(_message.Message):
    __slots__ = ("path", "size", "id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    id: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SaveTarget(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    attempt: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., attempt: _Optional[str] = ...) -> None: ...

class BeginSaveRequest(_message.Message):
    __slots__ = ("target", "tensors")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    target: SaveTarget
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, target: _Optional[_Union[SaveTarget, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "offset", "length", "arena_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    length: int
    arena_id: str
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., arena_id: _Optional[str] = ...) -> None: ...

class BeginSaveResponse(_message.Message):
    __slots__ = ("lease", "copy_check")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    COPY_CHECK_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    copy_check: CopyCheck
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., copy_check: _Optional[_Union[CopyCheck, _Mapping]] = ...) -> None: ...

class CopyCheck(_message.Message):
    __slots__ = ("chunk_ends", "chunk_hashes", "key")
    CHUNK_ENDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    chunk_ends: _containers.RepeatedScalarFieldContainer[int]
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    key: bytes
    def __init__(self, chunk_ends: _Optional[_Iterable[int]] = ..., chunk_hashes: _Optional[_Iterable[int]] = ..., key: _Optional[bytes] = ...) -> None: ...

class CommitSaveRequest(_message.Message):
    __slots__ = ("lease_id", "metadata", "chunk_hashes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    metadata: bytes
    chunk_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., metadata: _Optional[bytes] = ..., chunk_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitSaveResponse(_message.Message):
    __slots__ = ("target", "bytes")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    target: SaveTarget
    bytes: int
    def __init__(self, target: _Optional[_Union[SaveTarget, _Mapping]] = ..., bytes: _Optional[int] = ...) -> None: ...

class AbortSaveRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class AbortSaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveStreamHeader(_message.Message):
    __slots__ = ("target", "tensors", "metadata")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    target: SaveTarget
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    metadata: bytes
    def __init__(self, target: _Optional[_Union[SaveTarget, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class SaveStreamRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SaveStreamHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SaveStreamHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class WaitSaveRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "nowait", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NOWAIT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    nowait: bool
    attempt: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., nowait: _Optional[bool] = ..., attempt: _Optional[str] = ...) -> None: ...

class WaitSaveResponse(_message.Message):
    __slots__ = ("state", "error", "reason", "metadata", "replication_error")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_ERROR_FIELD_NUMBER: _ClassVar[int]
    state: SaveState
    error: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    replication_error: str
    def __init__(self, state: _Optional[_Union[SaveState, str]] = ..., error: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., replication_error: _Optional[str] = ...) -> None: ...

class ListStepsRequest(_message.Message):
    __slots__ = ("job", "tiers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    tiers: bool
    def __init__(self, job: _Optional[str] = ..., tiers: _Optional[bool] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("step", "world_size", "bytes", "stored_bytes", "committed_unix_nano", "attempt", "tiers", "memory_only", "ranks_held")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    RANKS_HELD_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    bytes: int
    stored_bytes: int
    committed_unix_nano: int
    attempt: str
    tiers: _containers.RepeatedScalarFieldContainer[str]
    memory_only: bool
    ranks_held: int
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., committed_unix_nano: _Optional[int] = ..., attempt: _Optional[str] = ..., tiers: _Optional[_Iterable[str]] = ..., memory_only: _Optional[bool] = ..., ranks_held: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepInfo]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepInfo, _Mapping]]] = ...) -> None: ...

class BeginRestoreRequest(_message.Message):
    __slots__ = ("job", "step", "latest", "rank", "tensors", "finite", "slices", "header_only", "in_place")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINITE_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    HEADER_ONLY_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    latest: bool
    rank: int
    tensors: _containers.RepeatedScalarFieldContainer[str]
    finite: bool
    slices: _containers.RepeatedCompositeFieldContainer[TensorSlice]
    header_only: bool
    in_place: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., latest: _Optional[bool] = ..., rank: _Optional[int] = ..., tensors: _Optional[_Iterable[str]] = ..., finite: _Optional[bool] = ..., slices: _Optional[_Iterable[_Union[TensorSlice, _Mapping]]] = ..., header_only: _Optional[bool] = ..., in_place: _Optional[bool] = ...) -> None: ...

class TensorSlice(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class RestoreHeader(_message.Message):
    __slots__ = ("step", "world_size", "tensors", "metadata", "size", "attempt", "tier", "skipped_step", "skipped_nonfinite", "copy_check", "in_place")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    COPY_CHECK_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    metadata: bytes
    size: int
    attempt: str
    tier: str
    skipped_step: int
    skipped_nonfinite: _containers.RepeatedScalarFieldContainer[int]
    copy_check: CopyCheck
    in_place: bool
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., metadata: _Optional[bytes] = ..., size: _Optional[int] = ..., attempt: _Optional[str] = ..., tier: _Optional[str] = ..., skipped_step: _Optional[int] = ..., skipped_nonfinite: _Optional[_Iterable[int]] = ..., copy_check: _Optional[_Union[CopyCheck, _Mapping]] = ..., in_place: _Optional[bool] = ...) -> None: ...

class BeginRestoreResponse(_message.Message):
    __slots__ = ("lease", "header")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    header: RestoreHeader
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., header: _Optional[_Union[RestoreHeader, _Mapping]] = ...) -> None: ...

class RestoreStreamResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: RestoreHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[RestoreHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRegionRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenDatasetRequest(_message.Message):
    __slots__ = ("source", "format", "batch_size", "rank", "world_size", "seed", "epoch", "start", "shuffle_window", "skip_corrupt", "delivered", "even", "batch_delivered", "mixture", "shuffle_block")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SKIP_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    EVEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    MIXTURE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    source: str
    format: str
    batch_size: int
    rank: int
    world_size: int
    seed: int
    epoch: int
    start: int
    shuffle_window: int
    skip_corrupt: bool
    delivered: _containers.RepeatedScalarFieldContainer[bytes]
    even: str
    batch_delivered: bool
    mixture: _containers.RepeatedCompositeFieldContainer[MixtureSource]
    shuffle_block: int
    def __init__(self, source: _Optional[str] = ..., format: _Optional[str] = ..., batch_size: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., shuffle_window: _Optional[int] = ..., skip_corrupt: _Optional[bool] = ..., delivered: _Optional[_Iterable[bytes]] = ..., even: _Optional[str] = ..., batch_delivered: _Optional[bool] = ..., mixture: _Optional[_Iterable[_Union[MixtureSource, _Mapping]]] = ..., shuffle_block: _Optional[int] = ...) -> None: ...

class MixtureSource(_message.Message):
    __slots__ = ("source", "format", "weight")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    source: str
    format: str
    weight: float
    def __init__(self, source: _Optional[str] = ..., format: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class OpenDatasetResponse(_message.Message):
    __slots__ = ("session", "shards")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    session: str
    shards: int
    def __init__(self, session: _Optional[str] = ..., shards: _Optional[int] = ...) -> None: ...

class NextBatchRequest(_message.Message):
    __slots__ = ("session", "release")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    session: str
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class SampleField(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("key", "fields")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    fields: _containers.RepeatedCompositeFieldContainer[SampleField]
    def __init__(self, key: _Optional[str] = ..., fields: _Optional[_Iterable[_Union[SampleField, _Mapping]]] = ...) -> None: ...

class PrefetchStats(_message.Message):
    __slots__ = ("wait_storage_ns", "wait_cache_ns", "wait_ring_ns", "wait_work_ns", "cache_hits", "cache_misses", "corrupt_skipped", "padded")
    WAIT_STORAGE_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_CACHE_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_RING_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_WORK_NS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PADDED_FIELD_NUMBER: _ClassVar[int]
    wait_storage_ns: int
    wait_cache_ns: int
    wait_ring_ns: int
    wait_work_ns: int
    cache_hits: int
    cache_misses: int
    corrupt_skipped: int
    padded: int
    def __init__(self, wait_storage_ns: _Optional[int] = ..., wait_cache_ns: _Optional[int] = ..., wait_ring_ns: _Optional[int] = ..., wait_work_ns: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., corrupt_skipped: _Optional[int] = ..., padded: _Optional[int] = ...) -> None: ...

class NextBatchResponse(_message.Message):
    __slots__ = ("lease", "samples", "position", "end", "stats", "delivered")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    position: int
    end: bool
    stats: PrefetchStats
    delivered: bytes
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., position: _Optional[int] = ..., end: _Optional[bool] = ..., stats: _Optional[_Union[PrefetchStats, _Mapping]] = ..., delivered: _Optional[bytes] = ...) -> None: ...

class CloseDatasetRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseDatasetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatasetPositionRequest(_message.Message):
    __slots__ = ("session", "position")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    session: str
    position: int
    def __init__(self, session: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class DatasetPositionResponse(_message.Message):
    __slots__ = ("delivered", "samples")
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    delivered: bytes
    samples: int
    def __init__(self, delivered: _Optional[bytes] = ..., samples: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DaemonStatus(_message.Message):
    __slots__ = ("version", "uptime_seconds", "default_job", "storage", "storage_ready", "storage_error", "arena", "saves", "leases", "datasets", "errors", "hot", "backend_errors")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BackendErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_JOB_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_READY_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ERROR_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    SAVES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HOT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_ERRORS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    default_job: str
    storage: str
    storage_ready: bool
    storage_error: str
    arena: ArenaUsage
    saves: _containers.RepeatedCompositeFieldContainer[SaveActivity]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseState]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetState]
    errors: _containers.ScalarMap[str, int]
    hot: HotTier
    backend_errors: _containers.ScalarMap[str, int]
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., default_job: _Optional[str] = ..., storage: _Optional[str] = ..., storage_ready: _Optional[bool] = ..., storage_error: _Optional[str] = ..., arena: _Optional[_Union[ArenaUsage, _Mapping]] = ..., saves: _Optional[_Iterable[_Union[SaveActivity, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[LeaseState, _Mapping]]] = ..., datasets: _Optional[_Iterable[_Union[DatasetState, _Mapping]]] = ..., errors: _Optional[_Mapping[str, int]] = ..., hot: _Optional[_Union[HotTier, _Mapping]] = ..., backend_errors: _Optional[_Mapping[str, int]] = ...) -> None: ...

class HotTier(_message.Message):
    __slots__ = ("bytes", "budget", "shards")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    budget: int
    shards: int
    def __init__(self, bytes: _Optional[int] = ..., budget: _Optional[int] = ..., shards: _Optional[int] = ...) -> None: ...

class ArenaUsage(_message.Message):
    __slots__ = ("size", "used", "staging", "restores", "datasets", "held", "datasets_share")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DATASETS_SHARE_FIELD_NUMBER: _ClassVar[int]
    size: int
    used: int
    staging: int
    restores: int
    datasets: int
    held: int
    datasets_share: int
    def __init__(self, size: _Optional[int] = ..., used: _Optional[int] = ..., staging: _Optional[int] = ..., restores: _Optional[int] = ..., datasets: _Optional[int] = ..., held: _Optional[int] = ..., datasets_share: _Optional[int] = ...) -> None: ...

class SaveActivity(_message.Message):
    __slots__ = ("target", "state", "seconds_in_state", "error", "age_seconds")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    target: SaveTarget
    state: str
    seconds_in_state: float
    error: str
    age_seconds: float
    def __init__(self, target: _Optional[_Union[SaveTarget, _Mapping]] = ..., state: _Optional[str] = ..., seconds_in_state: _Optional[float] = ..., error: _Optional[str] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class LeaseState(_message.Message):
    __slots__ = ("id_prefix", "kind", "peer", "bytes", "age_seconds", "expires_in_seconds", "target", "journaled")
    ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    JOURNALED_FIELD_NUMBER: _ClassVar[int]
    id_prefix: str
    kind: str
    peer: str
    bytes: int
    age_seconds: float
    expires_in_seconds: float
    target: SaveTarget
    journaled: bool
    def __init__(self, id_prefix: _Optional[str] = ..., kind: _Optional[str] = ..., peer: _Optional[str] = ..., bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ..., expires_in_seconds: _Optional[float] = ..., target: _Optional[_Union[SaveTarget, _Mapping]] = ..., journaled: _Optional[bool] = ...) -> None: ...

class DatasetState(_message.Message):
    __slots__ = ("peer", "source", "rank", "world_size", "epoch", "idle_seconds", "stats", "ring_slots", "ring_slots_max", "read_ahead_bytes", "read_ahead_target")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    RING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RING_SLOTS_MAX_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_TARGET_FIELD_NUMBER: _ClassVar[int]
    peer: str
    source: str
    rank: int
    world_size: int
    epoch: int
    idle_seconds: float
    stats: PrefetchStats
    ring_slots: int
    ring_slots_max: int
    read_ahead_bytes: int
    read_ahead_target: int
    def __init__(self, peer: _Optional[str] = ..., source: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., stats: _Optional[_Union[PrefetchStats, _Mapping]] = ..., ring_slots: _Optional[int] = ..., ring_slots_max: _Optional[int] = ..., read_ahead_bytes: _Optional[int] = ..., read_ahead_target: _Optional[int] = ...) -> None: ...

class PersistRequest(_message.Message):
    __slots__ = ("job", "step", "attempt")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    attempt: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., attempt: _Optional[str] = ...) -> None: ...

class PersistResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class HeldShard(_message.Message):
    __slots__ = ("step", "rank", "world_size", "attempt", "committed", "memory_only", "created_unix_nano", "manifest_hash", "original")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    world_size: int
    attempt: str
    committed: bool
    memory_only: bool
    created_unix_nano: int
    manifest_hash: str
    original: bool
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., attempt: _Optional[str] = ..., committed: _Optional[bool] = ..., memory_only: _Optional[bool] = ..., created_unix_nano: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., original: _Optional[bool] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[HeldShard]
    def __init__(self, shards: _Optional[_Iterable[_Union[HeldShard, _Mapping]]] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("manifest_size", "data_size", "committed", "memory_only", "error", "job", "step", "rank", "world_size", "attempt")
    MANIFEST_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    manifest_size: int
    data_size: int
    committed: bool
    memory_only: bool
    error: str
    job: str
    step: int
    rank: int
    world_size: int
    attempt: str
    def __init__(self, manifest_size: _Optional[int] = ..., data_size: _Optional[int] = ..., committed: _Optional[bool] = ..., memory_only: _Optional[bool] = ..., error: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., attempt: _Optional[str] = ...) -> None: ...

class ReplicaPiece(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetReplicaRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "attempt", "manifest_only")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    attempt: str
    manifest_only: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., attempt: _Optional[str] = ..., manifest_only: _Optional[bool] = ...) -> None: ...
