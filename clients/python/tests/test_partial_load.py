"""load(tensors=...) restores only the named tensors of a shard."""

from __future__ import annotations

import numpy as np
import pytest

import ckptd


def test_load_some_tensors(client, job):
    state = {
        "a": np.arange(300_000, dtype=np.float32),
        "b": np.ones((500, 300), dtype=np.int64),
        "c": np.arange(7, dtype=np.uint8),
    }
    client.save(1, state, rank=0, world_size=1, job=job).wait(30)
    got = client.load(1, rank=0, job=job, tensors=["c", "a"])
    assert set(got) == {"a", "c"}
    assert np.array_equal(got["a"], state["a"])
    assert np.array_equal(got["c"], state["c"])
    with pytest.raises(ckptd.InvalidArgumentError):
        client.load(1, rank=0, job=job, tensors=["nope"])
    with pytest.raises(TypeError):
        client.load(1, rank=0, job=job, tensors="a")
