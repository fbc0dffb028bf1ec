"""What the Python client saves, `ckptd restore` writes as readable safetensors."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import torch
from safetensors.torch import load_file as load_torch
from slow import scaled

import ckptd.torch as ct


def test_restore_writes_safetensors_with_the_flattened_names(
    client, daemon, ckptd_bin, job, tmp_path
):
    w = torch.randn(4, 3).to(torch.bfloat16)
    state = {
        "model": {"layer.0.weight": w},
        "rng": np.arange(5, dtype=np.uint32),
        "odd:key": np.ones(2),
    }
    client.save(1, state, job=job, metadata=b"position 42").wait(30)
    out = subprocess.run(
        [str(ckptd_bin), "restore", "--storage", str(daemon.storage), "--job", job, "--step", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tensors = load_torch(tmp_path / "rank-00000.safetensors")
    assert set(tensors) == {"model:layer.0.weight", "rng", "odd%3Akey"}
    assert torch.equal(tensors["model:layer.0.weight"], w)
    assert np.array_equal(tensors["rng"].numpy(), state["rng"])
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["step"] == 1


def test_torch_helper_shards_restore_too(client, daemon, ckptd_bin, job, tmp_path):
    model = torch.nn.Linear(3, 2)
    ct.save_state_dict(client, 1, model, job=job).wait(30)
    out = subprocess.run(
        [str(ckptd_bin), "restore", "--storage", str(daemon.storage), "--job", job, "--latest",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tensors = load_torch(tmp_path / "rank-00000.safetensors")
    assert torch.equal(tensors["model:weight"], model.weight.detach())
    skeleton = json.loads(tensors["ckptd.torch"].numpy().tobytes())
    assert skeleton["format"] == 1
