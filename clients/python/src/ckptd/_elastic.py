"""Gathering a dataset's elastic position across the ranks of a job."""

from __future__ import annotations

import sys
from typing import Any

from . import _position
from ._dataset import Dataset


def gather_dataset_state(dataset: Any, group: Any = None) -> dict[str, Any]:
    """Every rank's elastic position of an epoch, as one resumable state (JSON-safe).

    A collective over torch.distributed (``group``: the default group when
    None): each rank passes its dataset of the same epoch; all get the same
    dict, to store in the checkpoint.

    - A ``Dataset`` (``Client.dataset``): ``client.dataset(DatasetSpec(**state))``
      resumes the epoch at any world size: rank and world_size are left out
      (None: this process's), and delivered holds every old rank's position,
      unioned into one.
    - A ``ckptd.torch.CkptdIterableDataset``: ``load_state_dict(state)``
      resumes at any world size and any number of DataLoader workers (the
      same ones: exactly where each worker was).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        CkptdError: the Dataset is closed (see Dataset.state).
    """
    dist: Any = sys.modules.get("torch.distributed")  # initialized means imported
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gather_dataset_state needs torch.distributed to be initialized")
    if not isinstance(dataset, Dataset):  # a CkptdIterableDataset (ckptd.torch: torch's)
        states: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, dataset.state_dict(), group=group)
        return type(dataset).gathered(states)  # type: ignore[no-any-return]
    mine = dataset.state(elastic=True)
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, mine, group=group)
    delivered = _position.union(_position.blob(b) for s in states for b in s["delivered"])
    return {
        **mine,
        "rank": None,
        "world_size": None,
        "start": 0,
        "delivered": [_position.text(delivered)],
    }
