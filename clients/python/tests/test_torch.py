"""ckptd.torch: model, optimizer and extra state come back bit-exact."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

import ckptd
import ckptd.torch as ct
from ckptd import _arena


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype, k
            assert torch.equal(v, b[k]), k
        elif isinstance(v, dict):
            assert_same_state(v, b[k])
        else:
            assert v == b[k], k
            assert type(v) is type(b[k]), k


def test_model_and_adamw_round_trip_bit_exact(client, job):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    train(model, opt, 5, seed=1)
    extra = {
        "step": 5,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.default_rng(3).bit_generator.state,
        "legacy_numpy_rng": np.random.RandomState(4).get_state(),
        "python_rng": random.Random(5).getstate(),
        "loader": {"epoch": 2, "offset": 1234, "order": [3, 1, 2], "shard": "train-0007.tar"},
        "lr_history": (1e-3, float("inf"), -0.0, 1 / 3),
        "blob": b"\x00\x01",
        "none": None,
        "int_keys": {1: "a", "1": "b", (2, 3): "c"},
        "dtype": torch.bfloat16,
        "np_scalar": np.float32(1.25),
        "empty": {},
        "tensors": [torch.arange(3), torch.ones(2, 2, dtype=torch.bfloat16)],
    }
    ct.save_state_dict(client, 5, model, optimizer=opt, extra=extra, job=job, metadata=b"m").wait(
        30
    )

    torch.manual_seed(99)
    model2 = make_model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    got = ct.load_state_dict(client, 5, model2, optimizer=opt2, job=job)

    assert_same_state(model.state_dict(), model2.state_dict())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        assert_same_state(s1["state"][i], s2["state"][i])
    assert torch.equal(got["torch_rng"], extra["torch_rng"])
    assert got["numpy_rng"] == extra["numpy_rng"]
    assert got["legacy_numpy_rng"][0] == extra["legacy_numpy_rng"][0]
    assert np.array_equal(got["legacy_numpy_rng"][1], extra["legacy_numpy_rng"][1])
    assert got["legacy_numpy_rng"][2:] == extra["legacy_numpy_rng"][2:]
    assert got["python_rng"] == extra["python_rng"]
    for k in ("step", "loader", "lr_history", "blob", "none", "int_keys", "dtype", "empty"):
        assert got[k] == extra[k] and type(got[k]) is type(extra[k]), k
    assert str(got["lr_history"][2]) == "-0.0"
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == extra["np_scalar"]
    assert all(torch.equal(a, b) for a, b in zip(got["tensors"], extra["tensors"], strict=True))

    # Training on from both gives identical weights: nothing was lost.
    train(model, opt, 3, seed=7)
    train(model2, opt2, 3, seed=7)
    assert_same_state(model.state_dict(), model2.state_dict())


def test_random_state_restores_the_same_stream(client, job):
    model = torch.nn.Linear(2, 2)
    ct.save_state_dict(client, 1, model, extra={"rng": torch.get_rng_state()}, job=job).wait(30)
    expected = torch.rand(5)
    torch.rand(100)
    extra = ct.load_state_dict(client, 1, model, job=job)
    torch.set_rng_state(extra["rng"])
    assert torch.equal(torch.rand(5), expected)


def test_names_are_readable_in_the_shard(client, job):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_sgd = model(torch.ones(1, 3)).sum()
    train_sgd.backward()
    opt.step()
    ct.save_state_dict(
        client, 1, model, optimizer=opt, extra={"rng": torch.get_rng_state()}, job=job
    ).wait(30)
    flat = client.load(1, job=job, nested=False)
    assert {
        "model:weight",
        "model:bias",
        "optimizer:state:0:momentum_buffer",
        "extra:rng",
        "ckptd.torch",
    } <= set(flat)


def test_state_dict_mappings_and_latest(client, job):
    model = torch.nn.Linear(4, 4)
    sd = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    ct.save_state_dict(client, 3, sd, job=job).wait(30)
    ct.save_state_dict(client, 4, model, extra=4, job=job).wait(30)
    with torch.no_grad():
        model.weight.zero_()
    assert ct.load_state_dict(client, "latest", model, job=job) == 4
    assert torch.equal(model.weight, sd["weight"])


def test_errors(client, job):
    model = torch.nn.Linear(2, 2)
    client.save(1, {"w": np.zeros(2)}, job=job).wait(30)
    with pytest.raises(ckptd.CkptdError, match=r"not saved with ckptd\.torch"):
        ct.load_state_dict(client, 1, model, job=job)
    ct.save_state_dict(client, 2, model, job=job).wait(30)
    with pytest.raises(ValueError, match="without an optimizer"):
        ct.load_state_dict(
            client, 2, model, optimizer=torch.optim.SGD(model.parameters(), lr=1), job=job
        )
    with pytest.raises(TypeError, match="extra:bad is a object"):
        ct.save_state_dict(client, 3, model, extra={"bad": object()}, job=job)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ct.load_state_dict(client, 2, torch.nn.Linear(3, 2), job=job)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_device_round_trip(client, job, device):
    """CUDA tensors go by DMA through the registered arena; CPU ones by memcpy.

    Without CUDA (CI) this runs the CPU case and checks that nothing tried
    to register the arena; on a GPU machine it covers the CUDA path too.
    """
    src = {
        "w": torch.randn(64, 33, device=device).t(),
        "b": torch.arange(5, device=device, dtype=torch.bfloat16),
    }
    client.save(1, src, job=job).wait(30)
    got = client.load(1, job=job, device=device)
    for k, v in src.items():
        assert got[k].device.type == device and torch.equal(got[k], v), k
    assert client._conn.arena is not None
    assert client._conn.arena.pin() is torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert _arena._cuda_host_register(0, 4096) is False


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_fills_existing_tensors(client, job, device):
    """Client.load(into=...) copies into the tensors given where they fit, else makes new ones."""
    src = {
        "f": torch.randn(4, 5, device=device),
        "bf": torch.randn(7, device=device).to(torch.bfloat16),
        "i": torch.arange(6, device=device),
        "c": torch.randn(3, dtype=torch.complex64, device=device),
        "z": torch.empty(0, 3, device=device),
        "odd_dtype": torch.ones(3, device=device),
        "strided": torch.ones(4, 4, device=device),
        "grad": torch.ones(2, device=device),
        "n": np.arange(5, dtype=np.float64),
        "n_bad": np.arange(4, dtype=np.int32),
    }
    client.save(1, src, job=job).wait(30)
    into = {
        "f": torch.zeros(4, 5, device=device),
        "bf": torch.zeros(7, dtype=torch.bfloat16, device=device),
        "i": torch.zeros(6, dtype=torch.int64, device=device),
        "c": torch.zeros(3, dtype=torch.complex64, device=device),
        "z": torch.empty(0, 3, device=device),
        "odd_dtype": torch.zeros(3, dtype=torch.float64, device=device),  # not the saved dtype
        "strided": torch.zeros(4, 8, device=device)[:, ::2],  # not dense
        "grad": torch.zeros(2, device=device, requires_grad=True),
        "n": np.zeros(5),
        "n_bad": np.zeros(4, dtype=np.int64),
        "absent": torch.zeros(1),  # names no saved tensor: ignored
    }
    got = client.load(1, job=job, into=into, as_torch=True)
    for name in ("f", "bf", "i", "c", "z", "n"):
        assert got[name] is into[name], name
    for name in ("f", "bf", "i", "c", "z"):
        assert torch.equal(into[name], src[name]), name
    assert np.array_equal(into["n"], src["n"])
    for name in ("odd_dtype", "strided", "grad"):  # left alone, a new tensor returned
        assert got[name] is not into[name] and not into[name].detach().any(), name
        assert torch.equal(got[name].to(device), src[name]), name
    assert not into["n_bad"].any() and got["n_bad"] is not into["n_bad"]
    assert "absent" not in got


def test_load_state_dict_copies_once_into_the_model(client, job, monkeypatch):
    """The model's parameters and buffers get the saved bytes in place: no second copy.

    Tied weights stay tied; a model of another dtype still loads (cast by
    torch from new tensors), as before.
    """
    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 6)
            self.norm = torch.nn.BatchNorm1d(6)
            self.head = torch.nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    model.norm.running_mean.uniform_()
    ct.save_state_dict(client, 1, model, job=job).wait(30)

    loaded = []
    real_load = client.load
    monkeypatch.setattr(
        client, "load", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1]
    )
    model2 = Tied()
    params = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    ct.load_state_dict(client, 1, model2, job=job)
    assert_same_state(model.state_dict(), model2.state_dict())
    assert model2.head.weight is model2.emb.weight
    shard = loaded[0]["model"]
    assert "head.weight" not in shard  # tied: stored once, as emb.weight
    assert {k: v.data_ptr() for k, v in shard.items()} == {
        k: p for k, p in params.items() if k != "head.weight"
    }  # the model's own memory

    model3 = Tied().to(torch.float64)
    ct.load_state_dict(client, 1, model3, job=job)
    for k, v in model.state_dict().items():
        assert torch.equal(model3.state_dict()[k], v.to(model3.state_dict()[k].dtype)), k


def test_tied_weights_stored_once(client, job):
    """Entries that are one tensor (tied weights) are stored once; both load, tied or not."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 32)
    tied = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(32, 64, bias=False)})
    tied["head"].weight = emb.weight
    opt = torch.optim.SGD(tied.parameters(), lr=0.1, momentum=0.9)
    tied["head"](tied["emb"](torch.arange(4))).sum().backward()
    opt.step()
    ct.save_state_dict(client, 1, tied, optimizer=opt, extra={"again": emb.weight}, job=job).wait(
        30
    )
    names = set(client.load(1, job=job, nested=False))
    assert "model:emb.weight" in names and "model:head.weight" not in names
    assert "extra:again" not in names  # the same tensor, wherever it appears
    step = client.steps(job)[-1]
    assert step.bytes < 2 * emb.weight.nbytes + 4096  # model once, momentum once, skeleton

    untied = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(64, 32), "head": torch.nn.Linear(32, 64, bias=False)}
    )
    extra = ct.load_state_dict(client, 1, untied, job=job)
    assert torch.equal(untied["emb"].weight, emb.weight)
    assert torch.equal(untied["head"].weight, emb.weight)
    assert torch.equal(extra["again"], emb.weight)
    retied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(64, 32)})
    retied["head"] = torch.nn.Linear(32, 64, bias=False)
    retied["head"].weight = retied["emb"].weight
    opt2 = torch.optim.SGD(retied.parameters(), lr=0.1, momentum=0.9)
    ct.load_state_dict(client, 1, retied, optimizer=opt2, job=job)
    assert (
        torch.equal(retied["emb"].weight, emb.weight)
        and retied["head"].weight is retied["emb"].weight
    )
    assert torch.equal(
        opt2.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )


def test_load_into_a_model_with_keys_no_shard_holds(client, job):
    """A model entry no shard name can hold does not stop the in-place load of the rest."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 2)
    ct.save_state_dict(client, 1, saved, job=job).wait(30)
    model = torch.nn.Linear(3, 2)
    model.register_buffer("x" * 5000, torch.ones(1))  # longer than a tensor name may be
    ct.load_state_dict(client, 1, model, job=job, strict=False)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
