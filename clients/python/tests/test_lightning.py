"""ckptd.lightning.CheckpointIO with Lightning itself (CPU; DDP over gloo).

A DDP trainer of two processes is killed with SIGKILL inside a save (its
state staged, the save not returned), resumed with fit(ckpt_path="last"),
and ends where an uninterrupted run ends, bit for bit: weights, AdamW
state, the scheduler's LR, and every loss after the resume point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from slow import scaled

import ckptd

pl = pytest.importorskip("lightning.pytorch")
cl = pytest.importorskip("ckptd.lightning")

sys.path.insert(0, str(Path(__file__).with_name("frameworks")))
from common import read_losses, wait_paused  # noqa: E402

WORKER = Path(__file__).with_name("frameworks") / "lightning_worker.py"
EPOCHS = 6
# 64 samples in batches of 4: DDP deals them to the 2 ranks; Lightning's
# ModelParallelStrategy gives every rank all of them.
STEPS_PER_EPOCH = {"ddp": 8, "mp": 16}


def worker(socket: str, out: Path, tag: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "CKPTD_SOCKET": socket, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(out), tag, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # Lightning's second rank joins this group: one killpg ends both
    )  # fmt: skip


def finish(p: subprocess.Popen[str]) -> str:
    try:
        text = p.communicate(timeout=scaled(600))[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, text
    return text


@pytest.mark.parametrize("strategy", ["ddp", "mp"])
def test_killed_mid_save_resumes_bit_for_bit(daemon, job, tmp_path, strategy):
    """DDP with CheckpointIO, and ModelParallelStrategy (FSDP2, every rank saves its pieces)."""
    per_epoch = STEPS_PER_EPOCH[strategy]
    common = ["--epochs", str(EPOCHS), "--devices", "2", "--strategy", strategy]
    whole = worker(daemon.socket, tmp_path / "whole", "whole", "--job", f"{job}-w", *common)
    finish(whole)

    out = tmp_path / "killed"
    pause = 3 * per_epoch  # the end of epoch 3: last.ckpt still names epoch 2
    killed = worker(daemon.socket, out, "killed", "--job", job, *common, "--pause-at", str(pause))
    try:
        wait_paused(killed, out / "paused")
        os.killpg(killed.pid, signal.SIGKILL)  # both ranks, inside rank 0's save
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    assert killed.returncode == -signal.SIGKILL
    last = cl.read_pointer(out / "ckpts" / "last.ckpt")
    assert last is not None
    assert last["step"] == 2 * per_epoch  # the interrupted save left no pointer

    resumed = worker(daemon.socket, out, "resumed", "--job", job, *common, "--resume")
    text = finish(resumed)
    assert "Restored all states from the checkpoint" in text

    want = json.loads((tmp_path / "whole" / "final-whole.json").read_text())
    got = json.loads((out / "final-resumed.json").read_text())
    assert got == want  # weights, optimizer state, LR and the step
    for rank in (0, 1):
        after = read_losses(out / f"losses-resumed-rank{rank}.txt")
        assert min(after) == 2 * per_epoch  # it went on from last.ckpt's step
        reference = read_losses(tmp_path / "whole" / f"losses-whole-rank{rank}.txt")
        assert after == {s: reference[s] for s in after}
    # The interrupted run's staged step committed without its trainer (under
    # mp: if rank 1 had staged its pieces too); the resumed run saved that
    # step again, found it equal, and pointed at it.
    with daemon.client() as c:
        steps = c.steps(job)
    assert [s.step for s in steps] == [per_epoch * e for e in range(1, EPOCHS + 1)]
    assert {s.world_size for s in steps} == {2 if strategy == "mp" else 1}
    for e in range(EPOCHS):
        step = per_epoch * (e + 1)
        p = cl.read_pointer(out / "ckpts" / f"epoch={e}-step={step}.ckpt")
        assert p is not None and p["step"] == step and p["job"] == job


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8, data: Path = Path("/data")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, _):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, io, epochs, callbacks, ckpt_path=None):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, plugins=[io], callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    model = Tiny()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer, model


def test_top_k_last_best_and_plain_files(daemon, job, tmp_path):
    io = cl.CheckpointIO(socket=daemon.socket, job=job)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="loss", save_top_k=1, save_last=True
    )
    _, model = fit(tmp_path, io, 3, [ckpt])
    files = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert len(files) == 2 and "last.ckpt" in files  # top-1 removed the worse pointers
    best = cl.read_pointer(ckpt.best_model_path)
    assert best is not None
    with daemon.client() as c:
        assert [s.step for s in c.steps(job)] == [2, 4, 6]  # remove_checkpoint keeps steps

    # The checkpoint loads as Lightning's own would, hyper-parameters and all.
    loaded = io.load_checkpoint(ckpt.best_model_path, weights_only=False)
    assert loaded["global_step"] == best["step"]
    assert loaded["hyper_parameters"] == {"width": 8, "data": Path("/data")}
    assert "loops" in loaded and "optimizer_states" in loaded
    again = cl.load_from_checkpoint(
        Tiny, ckpt.last_model_path, socket=daemon.socket, weights_only=False
    )
    assert again.hparams == {"width": 8, "data": Path("/data")}
    for a, b in zip(again.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    # weights_only=True refuses to unpickle what JSON cannot hold (a Path here).
    with pytest.raises(ckptd.CkptdError, match="weights_only"):
        io.load_checkpoint(ckpt.last_model_path, weights_only=True)

    # ckpt_path="last" resumes from the pointer; a plain torch.save'd
    # Lightning file loads too (a run that switched to ckptd midway).
    trainer2, _ = fit(tmp_path, io, 4, [ckpt], ckpt_path="last")
    assert trainer2.global_step == 8
    plain = tmp_path / "plain.ckpt"
    trainer2.strategy.checkpoint_io = pl.plugins.TorchCheckpointIO()
    trainer2.save_checkpoint(plain)
    assert cl.read_pointer(plain) is None
    assert cl.read_pointer(tmp_path) is None  # a folder: Lightning's own sharded checkpoint
    assert io.load_checkpoint(plain, weights_only=False)["global_step"] == 8


def test_a_changed_state_at_a_saved_step_is_refused(daemon, job, tmp_path):
    io = cl.CheckpointIO(socket=daemon.socket, job=job)
    w = torch.zeros(4)
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": w}}, tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": w}, "x": 1}, tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt")["x"] == 1  # its own non-tensor state
    assert "x" not in io.load_checkpoint(tmp_path / "a.ckpt")
    w.add_(1)
    with pytest.raises(ckptd.CkptdError, match="differs"):
        io.save_checkpoint({"global_step": 3, "state_dict": {"w": w}}, tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()
    with pytest.raises(ValueError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "d.ckpt")
    io.teardown()


def test_a_resumed_run_waits_for_the_earlier_runs_save_of_its_step(daemon, job, tmp_path):
    """A killed run's staged save of step 5 still draining; the resumed run saves 5 too."""
    w = torch.randn(32 * 2**20 // 4)  # 32 MiB: the daemon drains it for a while
    earlier = cl.CheckpointIO(socket=daemon.socket, job=job)
    earlier.save_checkpoint({"global_step": 4, "state_dict": {"w": w}}, tmp_path / "4.ckpt")
    earlier.teardown()
    earlier.save_checkpoint({"global_step": 5, "state_dict": {"w": w + 1}}, tmp_path / "5.ckpt")
    # (earlier is "killed" here: its save of 5 is the daemon's now)
    resumed = cl.CheckpointIO(socket=daemon.socket, job=job)  # another attempt
    assert resumed.load_checkpoint(tmp_path / "4.ckpt")["global_step"] == 4
    resumed.save_checkpoint({"global_step": 5, "state_dict": {"w": w + 1}}, tmp_path / "r5.ckpt")
    resumed.teardown()  # no save of its own lost to the earlier one
    assert cl.read_pointer(tmp_path / "r5.ckpt")["step"] == 5
    with daemon.client() as c:
        assert {s.step: s.attempt for s in c.steps(job)}[5] == earlier.client.attempt

    again = cl.CheckpointIO(socket=daemon.socket, job=job)
    again.load_checkpoint(tmp_path / "4.ckpt")
    earlier.save_checkpoint({"global_step": 6, "state_dict": {"w": w + 2}}, tmp_path / "6.ckpt")
    with pytest.raises(ckptd.CkptdError, match="differs"):
        again.save_checkpoint({"global_step": 6, "state_dict": {"w": w}}, tmp_path / "r6.ckpt")
    earlier.teardown()
    again.teardown()


def test_import_error_names_the_extra():
    code = "import sys; sys.modules['lightning'] = None; import ckptd.lightning"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert "pip install 'ckptd[lightning]'" in run.stderr
