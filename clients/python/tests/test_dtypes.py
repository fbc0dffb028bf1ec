"""Every dtype torch can hold is stored and restored bit for bit, by every way in.

torch's dtypes are enumerated from the torch module itself, so a dtype a
later torch adds fails here until ckptd stores it (or refuses it on
purpose, as it does quantized tensors, whose scale and zero point are no
tensor bytes). Each goes through the plain client, ckptd.torch, ckptd.dcp
(one process here; four gloo ranks, resharded to 2 and 1, in test_dcp.py),
and `ckptd export` / `ckptd restore`, against a real daemon.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dtype_samples import (
    NAME,
    STORED,
    dcp_plans,
    dcp_samples,
    holdable,
    raw_bytes,
    same_bits,
    sample,
    torch_dtypes,
)
from safetensors import safe_open
from safetensors.torch import load_file
from slow import scaled

import ckptd.dcp
import ckptd.torch as ct
from ckptd import _tensors


def every_dtype() -> dict[str, dict[str, torch.Tensor]]:
    return {NAME[d]: sample(d, i) for i, d in enumerate(STORED)}


def check_all(got: Any, want: dict[str, dict[str, torch.Tensor]]) -> None:
    bad = [
        f"{d}.{k}" for d, ts in want.items() for k, t in ts.items() if not same_bits(got[d][k], t)
    ]
    assert not bad, f"not bit-exact: {bad}"


def test_every_dtype_torch_holds_is_known():
    """A dtype a later torch adds shows here first; quantized ones are refused."""
    known = set(_tensors._torch_dtypes(torch))
    for d in torch_dtypes():
        if holdable(d):
            assert d in known, f"ckptd has no name for {d}: add it to _tensors.DTYPES and Go's"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = torch.empty(1, dtype=d)  # a dtype torch cannot make at all fails here
            assert q.is_quantized, d
            with pytest.raises(TypeError, match=r"quantized tensor .*int_repr"):
                _tensors.make_leaf("q", q)
    # The six that were refused before, by name.
    for name in ("complex128", "complex32", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu", "float4_e2m1fn_x2"):  # fmt: skip
        assert getattr(torch, name) in STORED


def test_plain_client_round_trips_every_dtype(client, job):
    state = every_dtype()
    client.save(1, state, job=job).wait(scaled(60))
    check_all(client.load(1, job=job, as_torch=True), state)
    got = client.load(1, job=job)  # numpy arrays where numpy has the dtype, or torch's
    for d, ts in state.items():
        for k, t in ts.items():
            g = got[d][k]
            if isinstance(g, np.ndarray):
                g = torch.from_numpy(g)
            assert same_bits(g, t), f"{d}.{k}"


def test_numpy_complex128_round_trips(client, job):
    z = (np.arange(6) + 1j * np.arange(6)[::-1]).reshape(2, 3)[:, ::2]  # strided
    client.save(1, {"z": z, "be": z.astype(">c16")}, job=job).wait(scaled(60))
    got = client.load(1, job=job)
    assert got["z"].dtype == np.complex128 and np.array_equal(got["z"], z)
    assert np.array_equal(got["be"], z)


def test_ckptd_torch_round_trips_every_dtype(client, job):
    """As a model's buffers where torch's load_state_dict can copy the dtype, and as extra."""
    model = torch.nn.Module()
    copyable = []
    for d in STORED:
        try:
            torch.empty(2, dtype=d).copy_(torch.empty(2, dtype=d))
        except RuntimeError:  # torch's int1-7 and uint1-7 have no copy kernel
            continue
        copyable.append(d)
        model.register_buffer(f"b_{NAME[d]}", sample(d, 1)["grid"].clone())
    assert {torch.complex128, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu} <= set(copyable)
    want = {f"b_{NAME[d]}": getattr(model, f"b_{NAME[d]}").clone() for d in copyable}
    extra = every_dtype()
    ct.save_state_dict(client, 1, model, extra={"all": extra}, job=job).wait(scaled(60))
    for name in want:  # overwrite, then load back
        getattr(model, name).view(torch.uint8).zero_()
    got = ct.load_state_dict(client, 1, model, job=job)
    check_all(got["all"], extra)
    for name, t in want.items():
        assert same_bits(getattr(model, name), t), name


def test_dcp_round_trips_every_dtype_dcp_plans(client, job):
    """One process (no process group); four gloo ranks do the same in test_dcp.py."""
    for step, how in ((1, "save"), (2, "async_save")):
        sd = {"extra": dcp_samples(step)}
        writer = ckptd.dcp.Writer(client, step, job=job)
        if how == "save":
            dcp.save(sd, storage_writer=writer)
        else:
            dcp.async_save(sd, storage_writer=writer).result(timeout=scaled(120))
        target = {"extra": {n: torch.empty_like(_tensors.bits(torch, t)).view(t.dtype)
                            for n, t in sd["extra"].items()}}  # fmt: skip
        dcp.load(target, storage_reader=ckptd.dcp.Reader(client, step, job=job))
        bad = [n for n, t in sd["extra"].items() if not same_bits(target["extra"][n], t)]
        assert not bad, f"{how}: not bit-exact: {bad}"


def test_the_dtypes_dcp_cannot_plan_fail_with_its_own_writer_too(tmp_path):
    """torch's bits and sub-byte integers: DCP's planner has no size for them (torch 2.15).

    Once a torch plans them, this fails, and ckptd.dcp's test above takes them.
    """
    rest = [d for d in STORED if not dcp_plans(d)]
    assert torch.bits8 in rest and torch.uint4 in rest and torch.complex32 not in rest
    for d in rest:
        with pytest.raises(dcp.api.CheckpointException, match=r"iinfo"):
            dcp.save({"x": sample(d)["grid"]}, storage_writer=dcp.FileSystemWriter(tmp_path))


def _run(ckptd_bin, *args: str) -> None:
    out = subprocess.run(
        [str(ckptd_bin), *args], capture_output=True, text=True, timeout=scaled(300)
    )
    assert out.returncode == 0, out.stderr


def _safetensors_meta(path) -> dict[str, str]:
    with safe_open(path, "pt") as f:
        return f.metadata() or {}


def test_export_and_restore_write_every_dtype(client, daemon, ckptd_bin, job, tmp_path):
    """safetensors' own dtype where it has one; else the bytes as their parts or bits, named.

    float4_e2m1fn_x2 is safetensors' F4 (its last dimension counted in
    values), which loads back as torch's float4_e2m1fn_x2; a 0-d one as
    shape [1].
    """
    state = every_dtype()
    model = {f"{d}.{k}": t for d, ts in state.items() for k, t in ts.items()}
    client.save(1, {"model": model}, job=job).wait(scaled(60))
    store = ["--storage", str(daemon.storage), "--job", job, "--step", "1"]
    _run(ckptd_bin, "export", *store, "--out", str(tmp_path / "export"))
    _run(ckptd_bin, "restore", *store, "--out", str(tmp_path / "restore"))
    for path, prefix in ((tmp_path / "export" / "model.safetensors", ""),
                         (tmp_path / "restore" / "rank-00000.safetensors", "model:")):  # fmt: skip
        loaded = load_file(path)
        named = json.loads(_safetensors_meta(path).get("ckptd.dtypes", "{}"))
        stand_ins = {}
        for name, t in model.items():
            got = loaded[prefix + name]
            if prefix + name in named:  # stored as another dtype: the same bytes
                stand_ins[NAME[t.dtype]] = named[prefix + name]
                assert got.dtype != t.dtype and raw_bytes(got) == raw_bytes(t), name
            elif t.dtype == torch.float4_e2m1fn_x2 and t.dim() == 0:
                assert got.dtype == t.dtype and got.shape == (1,) and raw_bytes(got) == raw_bytes(t)
            else:
                assert same_bits(got, t), (name, got.dtype, got.shape)
        assert stand_ins == {
            "complex128": "C128", "complex32": "C32", "bcomplex32": "BCOMPLEX32",
            "bits8": "BITS8", "bits16": "BITS16", "bits1x8": "BITS1X8", "bits2x4": "BITS2X4",
            "bits4x2": "BITS4X2", **{f"int{n}": f"INT{n}" for n in range(1, 8)},
            **{f"uint{n}": f"UINT{n}" for n in range(1, 8)},
        }, path  # fmt: skip
        # The complex ones are their parts, as torch.view_as_real gives them.
        z = model["complex128.grid"]
        assert torch.equal(torch.view_as_complex(loaded[prefix + "complex128.grid"]), z)
