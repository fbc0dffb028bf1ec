"""ckptd.torchtitan: torchtitan 0.3's checkpointing through a real daemon, two gloo ranks.

torchtitan_worker.py runs torchtitan's training loop around its real
pieces and ckptd.torchtitan.CheckpointManager, built from its Config as the
Trainer builds config.checkpoint (torchtitan's Trainer itself needs an
accelerator: docs/torchtitan.md). A reference run trains 10 steps; another
job's run is killed with SIGKILL while the save of step 8 is staged and
not committed, and is resumed by a fresh run; runs of other jobs start
from the reference's steps (initial_load_path) or load one step. Each
continued run must equal the reference bit for bit: losses, and the full
state (weights, AdamW state, schedulers, data position) after every step.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import worker_env
from slow import scaled

pytest.importorskip("torchtitan", reason="pip install 'ckptd[torchtitan]' (make test installs it)")

WORKER = Path(__file__).with_name("torchtitan_worker.py")
WORLD, STEPS = 2, 10


def start(out: Path, **config: Any) -> list[subprocess.Popen[str]]:
    """Start WORLD ranks of the worker with a CheckpointManager.Config of config."""
    out.mkdir(parents=True, exist_ok=True)
    env = worker_env()
    cfg = json.dumps({"enable": True, "interval": 2, "last_save_model_only": False, **config})
    init = out / f"store-{time.monotonic_ns()}"
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(WORLD), str(init), str(out), cfg],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]


def finish(procs: list[subprocess.Popen[str]]) -> None:
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=scaled(600))[0])
    finally:
        for p in procs:
            p.kill()
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{text}"


def run(out: Path, **config: Any) -> dict[str, Any]:
    finish(start(out, **config))
    report: dict[str, Any] = json.loads((out / "run.json").read_text())
    return report


def state(out: Path, step: int | str) -> Any:
    return torch.load(out / f"state-{step}.pt", weights_only=False)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two saved states differ, tensors bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}.{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def steps_of(daemon: Any, job: str) -> list[int]:
    with daemon.client() as c:
        return [s.step for s in c.steps(job)]


@pytest.fixture(scope="module")
def ref(daemon, ckptd_bin, tmp_path_factory):
    """The uninterrupted run: 10 steps, a checkpoint every 2, async, keep_latest_k=3."""
    out = tmp_path_factory.mktemp("tt-ref")
    report = run(out, job="tt-ref", async_mode="async", keep_latest_k=3, steps=STEPS,
                 socket=daemon.socket, ckptd_bin=str(ckptd_bin))  # fmt: skip
    return out, report


def common(daemon: Any, ckptd_bin: Path) -> dict[str, Any]:
    return {"socket": daemon.socket, "ckptd_bin": str(ckptd_bin), "steps": STEPS}


def test_keep_latest_k_keeps_the_newest_committed_steps(ref, daemon):
    _, report = ref
    assert report["start"] == 0 and sorted(map(int, report["losses"])) == list(range(1, 11))
    assert steps_of(daemon, "tt-ref") == [6, 8, 10]


def test_kill_9_mid_save_then_resume_equals_the_uninterrupted_run(ref, daemon, ckptd_bin, tmp_path):
    ref_out, ref_report = ref
    job = "tt-kill"
    cfg = {"job": job, "async_mode": "async_with_pinned_mem", "keep_latest_k": 2,
           **common(daemon, ckptd_bin)}  # fmt: skip
    procs = start(tmp_path / "killed", hold_at=8, **cfg)
    deadline = time.monotonic() + scaled(300)
    held = [tmp_path / "killed" / f"held-{r}" for r in range(WORLD)]
    while not all(h.exists() for h in held):
        assert time.monotonic() < deadline, "the ranks never reached step 8's save"
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.05)
    # keep_latest_k=2 runs once step 6 is committed (step 2 goes), in rank 0's thread.
    while steps_of(daemon, job) != [4, 6]:
        assert time.monotonic() < deadline, steps_of(daemon, job)
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    # Step 8 was staged by rank 0, not saved by rank 1: it never commits, and
    # keep_latest_k, which waits for that, kept step 4.
    assert steps_of(daemon, job) == [4, 6]
    report = run(tmp_path / "resumed", **cfg)
    assert report["start"] == 6
    assert report["losses"] == {k: v for k, v in ref_report["losses"].items() if int(k) > 6}
    assert differences(state(tmp_path / "resumed", "start"), state(ref_out, 6)) == []
    for step in range(7, STEPS + 1):
        assert differences(state(tmp_path / "resumed", step), state(ref_out, step)) == [], step
    assert steps_of(daemon, job) == [8, 10]


def test_initial_load_path_from_a_ckptd_step(ref, daemon, ckptd_bin, tmp_path):
    """Another job starts from the reference's step 6 (all of it), synchronous saves."""
    ref_out, ref_report = ref
    report = run(tmp_path, job="tt-from-ref", async_mode="disabled", keep_latest_k=0,
                 initial_load_path="ckptd://tt-ref/step-6", initial_load_model_only=False,
                 **common(daemon, ckptd_bin))  # fmt: skip
    assert report["start"] == 6
    assert report["losses"] == {k: v for k, v in ref_report["losses"].items() if int(k) > 6}
    assert differences(state(tmp_path, STEPS), state(ref_out, STEPS)) == []
    assert steps_of(daemon, "tt-from-ref") == [8, 10]


def test_initial_load_model_only_and_load_at_a_step(ref, daemon, ckptd_bin, tmp_path):
    ref_out, _ = ref
    # Model only (torchtitan's default for an initial load): the weights, nothing else.
    report = run(tmp_path / "model", job="tt-model-only", initial_load_path="ckptd://tt-ref/latest",
                 **{**common(daemon, ckptd_bin), "steps": 1})  # fmt: skip
    got, want = state(tmp_path / "model", "start"), state(ref_out, STEPS)
    assert report["start"] == 0 and differences(got["model"], want["model"]) == []
    assert got["data"] == {"position": 0} and differences(got["optim"], want["optim"]) != []
    # load_step: that step of the job, whatever is newer.
    report = run(
        tmp_path / "at", job="tt-ref", load_step=8, **{**common(daemon, ckptd_bin), "steps": 8}
    )
    assert report["start"] == 8 and report["losses"] == {}
    assert differences(state(tmp_path / "at", "start"), state(ref_out, 8)) == []
    procs = start(tmp_path / "none", job="tt-ref", load_step=7, **common(daemon, ckptd_bin))
    texts = [p.communicate(timeout=scaled(300))[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "load_step=7: job tt-ref has no committed step 7 (committed: [6, 8, 10])" in texts[0]
