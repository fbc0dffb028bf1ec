"""Python client of the ckptd sidecar.

Save checkpoint shards of numpy and torch state through the daemon's
shared-memory arena -- the trainer's stall is one memory copy -- and load
them back::

    import ckptd

    with ckptd.Client() as c:                 # socket: $CKPTD_SOCKET or the daemon's default
        h = c.save(9000, state, metadata=b"loader position")
        ...                                   # keep training; ckptd drains in the background
        h.wait()                              # durable and committed
        state = c.load("latest")              # state.step, state.metadata

rank and world_size default to this process's: torch.distributed's when it
is initialized, else $RANK and $WORLD_SIZE (a launcher of several processes
without them is an error, not rank 0 of 1).

Read a dataset through the daemon's prefetching cache, batch by batch::

    for batch in c.dataset(ckptd.DatasetSpec("s3://bucket/train/", batch_size=32)):
        ...                                   # [{"__key__": ..., "jpg": b"...", "cls": b"3"}, ...]

``ckptd.torch`` saves and restores a model, its optimizer and extra values
(RNG states, data-loader position) bit-exactly, and adapts datasets to a
torch DataLoader (``ckptd.torch.CkptdIterableDataset``). ``on_preemption()``
turns SIGTERM / SIGUSR1 into a flag the loop checks to save and stop.
"""

from importlib import metadata as _metadata

from ._client import Client
from ._dataset import Dataset, DatasetSpec, DatasetStats
from ._elastic import gather_dataset_state
from ._errors import (
    AlreadyExistsError,
    CkptdError,
    ClientClosedError,
    CorruptShardError,
    DaemonUnavailableError,
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    NotReplicatedWarning,
    PermissionDeniedError,
    ResourceExhaustedError,
    SaveFailedError,
    StorageMisconfiguredError,
    StorageUnavailableError,
    StoreUnsafeError,
    TimeoutError,
    UntrustedDaemonError,
)
from ._handle import SaveHandle, SaveStatus
from ._load import LoadedState, StepInfo
from ._preempt import Preemption, on_preemption
from ._transport import default_socket

__all__ = [
    "AlreadyExistsError",
    "CkptdError",
    "Client",
    "ClientClosedError",
    "CorruptShardError",
    "DaemonUnavailableError",
    "DataLossError",
    "Dataset",
    "DatasetSpec",
    "DatasetStats",
    "InvalidArgumentError",
    "LoadedState",
    "NotFoundError",
    "NotReplicatedWarning",
    "PermissionDeniedError",
    "Preemption",
    "ResourceExhaustedError",
    "SaveFailedError",
    "SaveHandle",
    "SaveStatus",
    "StepInfo",
    "StorageMisconfiguredError",
    "StorageUnavailableError",
    "StoreUnsafeError",
    "TimeoutError",
    "UntrustedDaemonError",
    "__version__",
    "default_socket",
    "gather_dataset_state",
    "on_preemption",
]


def _version() -> str:
    """The installed distribution's version; "0.0.0+unknown" when not installed."""
    try:
        return _metadata.version("ckptd")
    except _metadata.PackageNotFoundError:
        return "0.0.0+unknown"


__version__: str = _version()
