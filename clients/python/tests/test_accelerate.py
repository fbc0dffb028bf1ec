"""ckptd.accelerate with accelerate itself: DDP over gloo, two processes, CPU.

Both ranks are killed with SIGKILL while rank 0 is inside a save (its
shard staged), resumed with load_state(accelerator, "latest"), and end
where an uninterrupted run ends, bit for bit: weights, AdamW state, LR, a
registered object, and every loss after the resume point (dropout on and
shuffled data: the RNG states come back too).
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

accelerate = pytest.importorskip("accelerate")
ca = pytest.importorskip("ckptd.accelerate")
sys.path.insert(0, str(Path(__file__).with_name("frameworks")))
from common import finish_ranks, kill_ranks, launch_ranks, read_losses, wait_paused  # noqa: E402

WORKER = Path(__file__).with_name("frameworks") / "accelerate_worker.py"


def test_ddp_killed_mid_save_resumes_bit_for_bit(daemon, job, tmp_path):
    finish_ranks(
        launch_ranks(WORKER, daemon.socket, tmp_path / "whole", "whole", "--job", f"{job}-w")
    )

    out = tmp_path / "killed"
    killed = launch_ranks(WORKER, daemon.socket, out, "killed", "--job", job, "--pause-at", "12")
    try:
        wait_paused(killed[0], out / "paused")
    finally:
        kill_ranks(killed)
    assert killed[0].returncode == -signal.SIGKILL

    finish_ranks(launch_ranks(WORKER, daemon.socket, out, "resumed", "--job", job, "--resume"))
    start = {int((out / f"resumed-resumed-rank{r}").read_text()) for r in (0, 1)}
    # Step 12 commits if rank 1 staged its shard before the kill, else 8 is the newest.
    assert start in ({8}, {12})
    begin = start.pop()
    want = json.loads((tmp_path / "whole" / "final-whole.json").read_text())
    assert json.loads((out / "final-resumed.json").read_text()) == want
    for r in (0, 1):
        after = read_losses(out / f"losses-resumed-rank{r}.txt")
        assert min(after) == begin + 1
        reference = read_losses(tmp_path / "whole" / f"losses-whole-rank{r}.txt")
        assert after == {s: reference[s] for s in after}
    with daemon.client() as c:
        assert [s.step for s in c.steps(job)] == [4, 8, 12, 16, 20, 24]
        assert {s.world_size for s in c.steps(job)} == {2}


def test_one_process_latest_and_refusals(daemon, job):
    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    with daemon.client() as c:
        assert ca.load_state(acc, "latest", client=c, job=job) is None  # nothing yet
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ca.save_state(acc, 5, client=c, job=job).wait(scaled(60))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        assert ca.load_state(acc, "latest", client=c, job=job) == 5
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k])


def test_import_error_names_the_extra():
    code = "import sys; sys.modules['accelerate'] = None; import ckptd.accelerate"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert "pip install 'ckptd[accelerate]'" in run.stderr
