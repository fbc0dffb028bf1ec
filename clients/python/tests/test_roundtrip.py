"""Save and load through a real daemon: every dtype, shape and nesting, bit-exact."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import ckptd
from ckptd import _tensors

NUMPY_DTYPES = [
    "?",
    "u1",
    "i1",
    "<u2",
    "<i2",
    "<f2",
    "<u4",
    "<i4",
    "<f4",
    "<u8",
    "<i8",
    "<f8",
    "<c8",
]
TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.uint16, torch.int16, torch.float16, torch.bfloat16,
    torch.uint32, torch.int32, torch.float32, torch.uint64, torch.int64, torch.float64,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Arbitrary bits (NaN payloads, subnormals and all) of the given dtype."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bits of a torch dtype, numpy having no bfloat16 or float8."""
    g = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    n = width * int(np.prod(shape))
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: object, b: object) -> bool:
    """Bit equality (NaN == NaN), with dtype, shape and kind all equal."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert isinstance(a, np.ndarray)
    return (
        isinstance(b, np.ndarray)
        and a.shape == b.shape
        and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
        and np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
        == np.ascontiguousarray(b).tobytes()
    )


def test_every_numpy_dtype_and_shape(client, job):
    rng = np.random.default_rng(0)
    shapes = [(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4)]
    state = {
        f"{dt}-{i}": random_array(rng, dt, s) for dt in NUMPY_DTYPES for i, s in enumerate(shapes)
    }
    client.save(1, state, job=job, metadata=b"\x00meta\xff").wait(30)
    got = client.load(1, job=job)
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert same_bits(v, got[k]), k
        assert got[k].flags.writeable
    assert got.metadata == b"\x00meta\xff"
    assert got.step == 1 and got.world_size == 1


def test_non_contiguous_and_odd_numpy_layouts(client, job):
    rng = np.random.default_rng(1)
    base = random_array(rng, "<f4", (6, 8))
    state = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "reversed": base[::-1, ::-1],
        "big_endian": random_array(rng, ">i4", (4, 5)),
        "broadcast": np.broadcast_to(np.arange(3, dtype=np.int64), (4, 3)),
        "scalar": np.float64(2.5),
        "fortran": np.asfortranarray(random_array(rng, "<f8", (3, 4))),
    }
    client.save(2, state, job=job).wait(30)
    got = client.load(2, job=job)
    for k, v in state.items():
        assert same_bits(np.asarray(v), got[k]), k
    assert got["scalar"].shape == ()


def test_every_torch_dtype_non_contiguous_0d_and_empty(client, job):
    state = {}
    for i, dt in enumerate(TORCH_DTYPES):
        name = str(dt).removeprefix("torch.")
        t = random_tensor(dt, (4, 6), seed=i)
        state[name] = {
            "plain": t,
            "t": t.t(),
            "slice": t[1:, ::2],
            "0d": t[2, 3],
            "empty": t[:0],
        }
    state["grad"] = torch.randn(3, 3, requires_grad=True) * 2  # a non-leaf with a grad_fn
    state["conj"] = torch.randn(3, dtype=torch.complex64).conj()  # lazily conjugated view
    client.save(3, state, job=job).wait(30)
    got = client.load(3, job=job, as_torch=True)
    for name, cases in state.items():
        if isinstance(cases, torch.Tensor):
            assert torch.equal(got[name], cases.detach().resolve_conj()), name
            continue
        for case, t in cases.items():
            assert same_bits(t, got[name][case]), (name, case)
            assert got[name][case].device.type == "cpu"


def test_numpy_load_gives_numpy_and_torch_for_bf16(client, job):
    bf = random_tensor(torch.bfloat16, (3, 2))
    f8 = random_tensor(torch.float8_e5m2, (5,))
    client.save(4, {"w": torch.arange(4, dtype=torch.float32), "bf": bf, "f8": f8}, job=job).wait(
        30
    )
    got = client.load(4, job=job, as_torch=False)
    assert isinstance(got["w"], np.ndarray) and got["w"].dtype == np.float32
    assert isinstance(got["bf"], torch.Tensor) and same_bits(bf, got["bf"])
    assert isinstance(got["f8"], torch.Tensor) and same_bits(f8, got["f8"])


def test_a_load_gives_back_what_was_saved(client, job):
    """torch in, torch out; numpy in, numpy out; a mix as it was (the default)."""
    model = torch.nn.Linear(3, 2)
    client.save(6, model.state_dict(), job=job).wait(30)
    got = client.load(6, job=job)
    assert set(got) == set(model.state_dict())  # the record of the kinds is not in it
    assert all(isinstance(v, torch.Tensor) for v in got.values())
    torch.nn.Linear(3, 2).load_state_dict(got)  # what failed with numpy arrays

    mixed = {"model": model.state_dict(), "step": np.asarray(6), "ema": {"w": torch.ones(2)}}
    client.save(7, mixed, job=job).wait(30)
    got = client.load(7, job=job)
    assert isinstance(got["step"], np.ndarray) and int(got["step"]) == 6
    assert isinstance(got["model"]["weight"], torch.Tensor)
    assert isinstance(got["ema"]["w"], torch.Tensor)
    flat = client.load(7, job=job, nested=False)
    assert set(flat) == {"model:weight", "model:bias", "step", "ema:w"}
    assert isinstance(client.load(7, job=job, as_torch=True)["step"], torch.Tensor)
    assert isinstance(client.load(7, job=job, as_torch=False)["ema"]["w"], np.ndarray)
    # Of some tensors only, the record is not read: numpy unless asked.
    assert isinstance(client.load(7, job=job, tensors=["ema:w"])["ema"]["w"], np.ndarray)

    client.save(8, {"a": np.arange(3)}, job=job).wait(30)  # numpy alone: as before, no record
    assert isinstance(client.load(8, job=job)["a"], np.ndarray)
    with pytest.raises(ckptd.InvalidArgumentError, match="reserved"):
        client.save(9, {"ckptd.as": torch.ones(1), "w": torch.ones(1)}, job=job)


def test_bf16_without_torch_comes_back_as_raw_bits(client, job, monkeypatch):
    bf = random_tensor(torch.bfloat16, (3, 2))
    client.save(5, {"bf": bf}, job=job).wait(30)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    assert _tensors.torch_module() is None
    got = client.load(5, job=job)
    assert got["bf"].dtype == np.uint16
    assert np.array_equal(got["bf"], bf.view(torch.int16).numpy().view(np.uint16))


def test_nested_flat_and_weird_keys(client, job):
    state = {
        "model": {"layer.0.weight": np.ones(2, np.float32), "a:b": np.zeros(1, np.int8)},
        "a:b": {"..": np.arange(3, dtype=np.int16)},
        "100%": np.array([True, False]),
        "ünicode key": np.array(1.5, np.float16),
    }
    client.save(6, state, job=job).wait(30)
    got = client.load(6, job=job)
    assert got.keys() == state.keys()
    assert got["model"].keys() == state["model"].keys()
    assert np.array_equal(got["a:b"][".."], state["a:b"][".."])
    flat = client.load(6, job=job, nested=False)
    assert set(flat) == {
        "model:layer.0.weight",
        "model:a%3Ab",
        "a%3Ab:%2E.",
        "100%25",
        "ünicode key",
    }


def test_order_is_kept(client, job):
    state = {k: np.full(2, i, np.int64 if i % 2 else np.int8) for i, k in enumerate("zyxabc")}
    client.save(7, state, job=job).wait(30)
    assert list(client.load(7, job=job)) == list("zyxabc")


def test_empty_state_round_trips(client, job):
    client.save(8, {}, job=job, metadata=b"only metadata").wait(30)
    got = client.load(8, job=job)
    assert got == {} and got.metadata == b"only metadata"


def test_loaded_arrays_are_private_copies(client, job):
    client.save(9, {"a": np.arange(1000, dtype=np.int32)}, job=job).wait(30)
    a = client.load(9, job=job)["a"]
    b = client.load(9, job=job)["a"]
    a[:] = -1  # writable, and not shared with the arena or another load
    assert np.array_equal(b, np.arange(1000, dtype=np.int32))


def test_stream_transport_round_trips(daemon, job):
    rng = np.random.default_rng(2)
    big = random_array(rng, "<f4", (700, 1000))  # several 1 MiB stream messages
    state = {
        "big": big[:, ::2],
        "mix": {"b": np.array([1, 0], bool), "l": np.arange(3, dtype=np.int64)},
        "bf": random_tensor(torch.bfloat16, (3, 3)).t(),
        "e": np.zeros((0,), np.float64),
    }
    with daemon.client(transport="stream") as c:
        c.save(10, state, job=job, metadata=b"m").wait(30)
        got = c.load(10, job=job)
    assert same_bits(state["big"], got["big"])
    assert same_bits(state["mix"]["l"], got["mix"]["l"])
    assert same_bits(state["bf"], got["bf"])
    assert got.metadata == b"m"
    with daemon.client() as c:  # what one transport saved, the other loads
        assert same_bits(state["big"], c.load(10, job=job)["big"])


def test_steps_and_latest(client, job):
    assert client.steps(job) == []
    assert client.latest_step(job) is None
    for s in (5, 3, 12):
        client.save(s, {"x": np.array([s])}, job=job).wait(30)
    infos = client.steps(job)
    assert [i.step for i in infos] == [3, 5, 12]
    assert all(i.world_size == 1 and i.bytes == 8 and i.stored_bytes > 0 for i in infos)
    assert client.latest_step(job) == 12
    got = client.load("latest", job=job)
    assert got.step == 12 and int(got["x"][0]) == 12


def test_multi_rank_step_commits_when_every_rank_saved(client, job):
    run = {"world_size": 2, "job": job, "attempt": "run-1"}  # the ranks of one run
    h0 = client.save(1, {"w": np.zeros(4, np.float32)}, rank=0, **run)
    with pytest.raises(ckptd.TimeoutError):
        h0.wait(timeout=0.5)  # rank 1 is missing
    assert h0.status == ckptd.SaveStatus.DURABLE  # its data is safe; the step waits for rank 1
    h1 = client.save(1, {"w": np.ones(4, np.float32)}, rank=1, **run)
    h0.wait(30)
    h1.wait(30)
    assert client.load(1, rank=1, job=job)["w"][0] == 1.0
    assert client.steps(job)[0].world_size == 2
