"""Save on preemption, as a scheduler delivers it: a real trainer process gets
SIGUSR1 (Slurm's --signal) or SIGTERM (Kubernetes, systemd) mid-run, saves the
step it is in, waits for the commit and exits 0; the step resumes to the
same weights an uninterrupted run ends with. Under torch.distributed (gloo)
a signal to one rank stops every rank at the same step, which commits."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from slow import scaled
from test_example import SCRIPT, digest, run

import ckptd

WORKER = Path(__file__).with_name("preempt_worker.py")


class Lines:
    """A process's stdout, line by line, waited on with deadlines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, pattern: str, seconds: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + scaled(seconds)
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line like {pattern!r} in time: {self.seen}") from None
            if line is None:
                raise AssertionError(f"ended without a line like {pattern!r}: {self.seen}")
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_preempted_run_saves_its_step_and_resumes(daemon, job, sig):
    whole = digest(run(daemon.socket, f"{job}-whole"))
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--steps", "60", "--ckpt-every", "1000",
         "--socket", daemon.socket, "--job", job, "--step-sleep", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out = Lines(proc)
        out.until(r"^step 5 ")
        proc.send_signal(sig)  # mid-run: no checkpoint so far (--ckpt-every 1000)
        m = out.until(rf"^preempted by {sig.name} after step (\d+);")
        assert proc.wait(scaled(60)) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
    step = int(m.group(1))
    assert f"committed step {step}" in out.seen
    with ckptd.Client(daemon.socket) as c:
        assert c.latest_step(job) == step  # committed before the process exited
    resumed = run(daemon.socket, job, "--resume", "latest")
    assert resumed.splitlines()[0] == f"resumed from step {step}"
    assert digest(resumed) == whole


def test_one_rank_signalled_stops_every_rank_at_the_same_step(daemon, job):
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-preempt-"))
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ATTEMPT"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", str(tmp / "store"), daemon.socket, job],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        lines = [Lines(p) for p in procs]
        for out in lines:
            out.until(r"^step 3$")
        procs[0].send_signal(signal.SIGUSR1)  # rank 0 only, as a signal may reach one node
        saved = [int(out.until(r"^saved (\d+)$").group(1)) for out in lines]
        for r, p in enumerate(procs):
            assert p.wait(scaled(60)) == 0, f"rank {r}: {lines[r].seen}"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    assert saved[0] == saved[1], saved
    assert any("got SIGUSR1" in line for line in lines[0].seen)
    assert not any("got SIG" in line for line in lines[1].seen)
    with ckptd.Client(daemon.socket) as c:
        [info] = [s for s in c.steps(job) if s.step == saved[0]]
    assert info.world_size == 2


def test_on_preemption_in_process():
    with ckptd.on_preemption(["USR2"]) as p:
        assert not p.requested() and p.signal is None
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + scaled(10)
        while p.signal is None:  # the handler runs between bytecodes of this thread
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert p.requested() and p.signal == signal.SIGUSR2
        assert p.requested()  # it stays so
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # put back
    with pytest.raises(ValueError, match="unknown signal"):
        ckptd.on_preemption(["SIGNOPE"])
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(errors, ckptd.on_preemption))
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])


def _catch(errors: list[BaseException], fn) -> None:
    try:
        fn()
    except RuntimeError as e:
        errors.append(e)
