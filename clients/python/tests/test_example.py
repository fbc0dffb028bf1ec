"""examples/train.py: killed and resumed, it ends where an uninterrupted run ends."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slow import scaled

import ckptd

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "train.py"
ARGS = ["--steps", "60", "--ckpt-every", "10"]


def run(socket: str, job: str, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--socket", socket, "--job", job, *extra],
        capture_output=True, text=True, timeout=scaled(300),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def digest(stdout: str) -> str:
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("final weights sha256 "), line
    return line.split()[-1]


def test_kill_and_resume_equals_uninterrupted(daemon, job):
    whole = run(daemon.socket, f"{job}-whole")
    assert "committed step 60" in whole

    killed_job = f"{job}-killed"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *ARGS, "--socket", daemon.socket, "--job", killed_job,
         "--step-sleep", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with daemon.client() as c:
            deadline = time.monotonic() + scaled(120)
            while (c.latest_step(killed_job) or 0) < 20:  # killed with checkpoints behind it
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "no checkpoint committed in time"
                time.sleep(0.02)
        proc.kill()  # SIGKILL: no cleanup, maybe mid-save
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9, "the run ended before it could be killed"

    resumed = run(daemon.socket, killed_job, "--resume", "latest")
    first = resumed.splitlines()[0]
    assert first.startswith("resumed from step "), first
    assert int(first.split()[-1]) >= 20
    assert digest(resumed) == digest(whole)
    with daemon.client() as c:
        assert c.latest_step(killed_job) == 60


def test_resume_latest_with_nothing_saved_starts_fresh(daemon, job):
    out = run(daemon.socket, job, "--resume", "latest", "--steps", "10")
    assert out.splitlines()[0] == "no committed checkpoint yet; starting from scratch"


def test_example_finds_the_daemon_through_the_environment(daemon, job):
    env = {**os.environ, "CKPTD_SOCKET": daemon.socket}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", "--ckpt-every", "3", "--job", job],
        capture_output=True, text=True, timeout=scaled(300), env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with ckptd.Client(daemon.socket) as c:
        assert c.latest_step(job) == 3


def test_a_step_an_earlier_run_committed_is_skipped_with_a_line_saying_so(daemon, job):
    run(daemon.socket, job, "--steps", "10", "--ckpt-every", "5")
    again = run(daemon.socket, job, "--steps", "10", "--ckpt-every", "5")  # no --resume
    for step in (5, 10):
        assert re.search(
            rf"step {step} was already committed by attempt '[0-9a-f]+'; not saving it again", again
        ), again
        assert f"saved step {step}" not in again


def load_example():
    spec = importlib.util.spec_from_file_location("train_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Refusing:
    """A client whose saves fail with the given error."""

    attempt = "this-run"
    _attempt_random = False

    def __init__(self, err: Exception) -> None:
        self.err = err

    def save(self, *a, **kw):
        raise self.err

    def steps(self, job=None):
        return []


def test_other_already_exists_errors_are_raised():
    train = load_example()
    args = train.parse_args(["--job", "j"])
    model, opt, data, _ = train.build(0)
    for err in (
        ckptd.AlreadyExistsError("x", reason="SAVE_IN_PROGRESS", metadata={"attempt": "this-run"}),
        ckptd.AlreadyExistsError("x", reason="STEP_COMMITTED", metadata={"attempt": "this-run"}),
    ):
        with pytest.raises(ckptd.AlreadyExistsError):
            train.checkpoint(Refusing(err), args, 5, model, opt, data)
    other = ckptd.AlreadyExistsError("x", reason="STEP_COMMITTED", metadata={"attempt": "old"})
    assert train.checkpoint(Refusing(other), args, 5, model, opt, data) is None
