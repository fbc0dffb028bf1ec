"""The public API's shape: keyword-only arguments, DatasetSpec, load("latest"), __version__."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import numpy as np
import pytest
import torch

import ckptd
import ckptd.torch as ct

# ---- keyword-only arguments -------------------------------------------------------


def test_arguments_after_the_first_ones_are_keyword_only(client, job):
    state = {"w": np.zeros(1)}
    calls = [
        lambda: ckptd.Client(client.socket, 5.0),
        lambda: client.save(1, state, 0),
        lambda: client.save(1, state, 0, 1, b"", job),
        lambda: client.load(1, 0),
        lambda: client.handle(1, 0),
        lambda: client.dataset(ckptd.DatasetSpec("/data"), False),
        lambda: ckptd.DatasetSpec("/data", "raw"),
        lambda: ct.save_state_dict(client, 1, torch.nn.Linear(1, 1), None),
        lambda: ct.load_state_dict(client, 1, None, None),
        lambda: ct.CkptdIterableDataset(ckptd.DatasetSpec("/data"), "sock"),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="positional argument"):
            call()
    assert client.steps(job) == []  # none of them reached the daemon


# ---- load(step) --------------------------------------------------------------------


def test_load_takes_a_step_or_latest(client, job):
    for s in (3, 7, 5):
        client.save(s, {"x": np.array([s])}, job=job).wait(30)
    assert client.load("latest", job=job).step == 7
    assert client.load(5, job=job).step == 5
    assert client.load(np.int64(3), job=job).step == 3
    with pytest.raises(ValueError, match=r'step must be an int or "latest", not \'last\''):
        client.load("last", job=job)  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 2)
    ct.save_state_dict(client, 9, model, extra={"at": 9}, job=job).wait(30)
    assert ct.load_state_dict(client, "latest", model, job=job) == {"at": 9}
    with pytest.raises(ValueError, match='"latest"'):
        ct.load_state_dict(client, "Latest", model, job=job)  # type: ignore[arg-type]


# ---- DatasetSpec -------------------------------------------------------------------


def test_dataset_spec_defaults_and_checks(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    spec = ckptd.DatasetSpec("shards")
    assert spec.as_dict() == {
        "source": str(tmp_path / "shards"),  # relative to the trainer's cwd, not the daemon's
        "format": "webdataset",
        "batch_size": 32,
        "rank": 0,
        "world_size": 1,
        "seed": 0,
        "epoch": 0,
        "start": 0,
        "shuffle_window": None,
        "skip_corrupt": False,
        "delivered": [],  # positions as base64 text: the dict is JSON-safe
        "even": "pad",
        "shuffle_block": 0,
    }
    assert ckptd.DatasetSpec(tmp_path).source == str(tmp_path)  # a path-like
    assert ckptd.DatasetSpec("s3://bucket/train/").source == "s3://bucket/train/"
    assert ckptd.DatasetSpec(**spec.as_dict()) == spec
    assert ckptd.DatasetSpec("x", batch_size=np.int32(4)).batch_size == 4
    assert type(ckptd.DatasetSpec("x", batch_size=np.int32(4)).batch_size) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.epoch = 1  # type: ignore[misc]
    assert dataclasses.replace(spec, epoch=1).epoch == 1
    # Checked once, where it is made: before any daemon is asked.
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ckptd.DatasetSpec("x", batch_size=4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="world_size must be an int"):
        ckptd.DatasetSpec("x", rank=0, world_size="2")  # type: ignore[arg-type]
    with pytest.raises(ckptd.InvalidArgumentError, match=r"seed -1 is out of range"):
        ckptd.DatasetSpec("x", seed=-1)  # seed is a uint64 in the protocol
    with pytest.raises(ckptd.InvalidArgumentError, match="empty"):
        ckptd.DatasetSpec("")


def test_dataset_spec_rank_defaults_to_this_process(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    spec = ckptd.DatasetSpec("/data")
    assert (spec.rank, spec.world_size) == (3, 8)
    given = ckptd.DatasetSpec("/data", rank=1, world_size=2)
    assert (given.rank, given.world_size) == (1, 2)
    assert ckptd.DatasetSpec("/data", world_size=16).rank == 3


def test_client_dataset_takes_a_spec(client):
    with pytest.raises(TypeError, match=r"takes a ckptd\.DatasetSpec, not str"):
        client.dataset("/data")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"takes a ckptd\.DatasetSpec, not dict"):
        ct.CkptdIterableDataset({"source": "/data"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_state_dict"):
        ct.CkptdIterableDataset(ckptd.DatasetSpec("/data", start=5))
    ds = ct.CkptdIterableDataset(ckptd.DatasetSpec("/data", rank=1, world_size=2, seed=4, epoch=3))
    assert (ds.rank, ds.world_size, ds.seed, ds.epoch) == (1, 2, 4, 3)
    assert ct.DatasetSpec is ckptd.DatasetSpec


# ---- __version__ -------------------------------------------------------------------


def test_version_is_the_installed_distributions():
    assert ckptd.__version__ == importlib.metadata.version("ckptd")
    assert ckptd.__version__ != "0.0.0+unknown"
    assert "__version__" in ckptd.__all__


def test_version_without_package_metadata(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert ckptd._version() == "0.0.0+unknown"
