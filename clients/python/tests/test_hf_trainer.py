"""ckptd.hf.Trainer with transformers' Trainer itself (a tiny GPT-2, CPU).

Killed with SIGKILL while rank 0 is inside a save (its state staged), a
DDP trainer of two processes (gloo) resumes with
train(resume_from_checkpoint=True) from the newest committed step and ends
where an uninterrupted run ends, bit for bit: weights, AdamW state, LR and
every loss after the resume point (dropout on: the RNG states of every
rank are restored too). The step exports to a folder from_pretrained
loads.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from slow import scaled

import ckptd

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("ckptd.hf")
sys.path.insert(0, str(Path(__file__).with_name("frameworks")))
from common import finish_ranks, kill_ranks, launch_ranks, read_losses, wait_paused  # noqa: E402

WORKER = Path(__file__).with_name("frameworks") / "hf_worker.py"


def test_ddp_killed_mid_save_resumes_bit_for_bit(daemon, ckptd_bin, job, tmp_path):
    whole = tmp_path / "whole"
    finish_ranks(launch_ranks(WORKER, daemon.socket, whole, "whole", "--job", f"{job}-w"))

    out = tmp_path / "killed"
    killed = launch_ranks(WORKER, daemon.socket, out, "killed", "--job", job, "--pause-at", "18")
    try:
        wait_paused(killed[0], out / "paused")
    finally:
        kill_ranks(killed)
    assert killed[0].returncode == -signal.SIGKILL

    finish_ranks(launch_ranks(WORKER, daemon.socket, out, "resumed", "--job", job, "--resume"))
    want = json.loads((whole / "final-whole.json").read_text())
    assert json.loads((out / "final-resumed.json").read_text()) == want
    for r in (0, 1):
        after = read_losses(out / f"losses-resumed-rank{r}.txt")
        # Step 18 commits if rank 1 staged its shard before the kill, else 12 is the newest.
        assert min(after) in (13, 19)  # mid-epoch either way (8 steps an epoch on 2 ranks)
        reference = read_losses(whole / f"losses-whole-rank{r}.txt")
        assert after == {s: reference[s] for s in after}
    assert not (out / "hf" / "checkpoint-18").exists()  # no folders: the steps are in ckptd
    with daemon.client() as c:
        steps = c.steps(job)
    assert [s.step for s in steps] == [6, 12, 18, 24]
    assert {s.world_size for s in steps} == {2}

    # The step carries config.json: `ckptd export` writes a folder from_pretrained loads.
    export = subprocess.run(
        [str(ckptd_bin), "export", "--storage", str(daemon.storage), "--job", job, "--step",
         "24", "--out", str(tmp_path / "export")],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    with daemon.client() as c:
        saved = c.load(24, job=job, rank=0)
    weights = model.state_dict()
    assert weights.keys() - saved["model"].keys() == {"lm_head.weight"}  # tied: stored once
    for name, p in saved["model"].items():
        assert torch.equal(weights[name], p), name


def tiny_trainer(tmp_path, daemon, job, **args):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 16, (8, 8))]
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, use_cpu=True,
        report_to="none", disable_tqdm=True, **args,
    )  # fmt: skip
    return hf.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=targs, train_dataset=data,
        eval_dataset=data, ckptd_socket=daemon.socket, ckptd_job=job,
    )  # fmt: skip


def test_resume_with_nothing_committed_and_save_total_limit(daemon, job, tmp_path):
    trainer = tiny_trainer(tmp_path, daemon, job, max_steps=4, save_steps=1, save_total_limit=1)
    with pytest.raises(ValueError, match="No committed ckptd step"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.warns(RuntimeWarning, match="ckptd prune --keep-last 1"):
        trainer.train()
    with daemon.client() as c:
        assert [s.step for s in c.steps(job)] == [1, 2, 3, 4]  # nothing deleted
    with pytest.raises(ValueError, match="checkpoint-<step>"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "elsewhere"))
    # A path naming checkpoint-<step> resumes from that step; retraining
    # step 4 finds it committed, equal bit for bit, and takes it.
    again = tiny_trainer(tmp_path, daemon, job, max_steps=4, save_steps=1)
    again.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-3"))
    assert again.state.global_step == 4
    other = tiny_trainer(tmp_path, daemon, job, max_steps=1, save_steps=1, learning_rate=1.0)
    with pytest.raises(ckptd.CkptdError, match="other values"):
        other.train()  # step 1 again, from scratch, trained otherwise


def test_load_best_model_at_end_is_refused(daemon, job, tmp_path):
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        tiny_trainer(
            tmp_path, daemon, job, load_best_model_at_end=True, eval_strategy="steps",
            save_strategy="steps",
        )  # fmt: skip


def test_import_error_names_the_extra():
    code = "import sys; sys.modules['transformers'] = None; import ckptd.hf"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert "pip install 'ckptd[hf]'" in run.stderr
