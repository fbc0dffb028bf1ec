"""A dead trainer frees what it held, and runs of a job never mix.

Real client processes are killed with SIGKILL while they hold arena space;
attempts (runs) are played by clients with different attempt ids.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ckptd

HOLDER = textwrap.dedent(
    """
    import sys, time
    import ckptd
    from ckptd.v1 import ckptd_pb2 as pb
    socket, job, attempt, what = sys.argv[1:5]
    c = ckptd.Client(socket, attempt=attempt)
    if what == "save":
        t = pb.SaveTarget(job=job, step=7, rank=0, world_size=1, attempt=attempt)
        n = 32 << 20
        table = [pb.Tensor(name="w", dtype="U8", shape=[n], offset=0, length=n)]
        c._conn.stub.BeginSave(pb.BeginSaveRequest(target=t, tensors=table))
    else:
        for _ in range(4):
            c._conn.stub.BeginRestore(pb.BeginRestoreRequest(job=job, step=1, rank=0))
    print("held", flush=True)
    time.sleep(3600)
    """
)


def hold(daemon, job, attempt, what):
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, daemon.socket, job, attempt, what],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("what", ["save", "restores"])
def test_killed_trainer_frees_its_regions(make_daemon, job, what):
    d = make_daemon(staging="64MiB")
    with d.client(attempt="run-1") as c:
        c.save(1, {"w": np.arange(1 << 20, dtype=np.float32)}, job=job).wait(30)
        p = hold(d, job, "run-1", what)
        p.kill()
        p.wait()
        # The restarted trainer (same run) saves what the dead one was
        # saving, 48 MiB of a 64 MiB arena: only possible once the dead
        # one's regions are free, within seconds rather than --lease-timeout.
        # The daemon frees them when it sees the connection close, which
        # may come a moment after the kill: until then the dead one's save
        # is still in progress, and the step refused as being saved.
        start = time.monotonic()
        while True:
            try:
                h = c.save(7, {"w": np.ones(48 << 20, dtype=np.uint8)}, job=job)
                break
            except ckptd.AlreadyExistsError as e:
                if "being saved" not in str(e) or time.monotonic() - start > 20:
                    raise
                time.sleep(0.05)
        h.wait(60)
        assert time.monotonic() - start < 20
        assert c.load(7, job=job)["w"].sum() == 48 << 20


def test_runs_never_mix(make_daemon, job):
    d = make_daemon()
    old, new = d.client(attempt="old-run"), d.client(attempt="new-run")
    with old, new:
        h_old = old.save(100, {"w": np.zeros(4)}, rank=0, world_size=2, job=job)
        while h_old.status not in (ckptd.SaveStatus.DURABLE, ckptd.SaveStatus.FAILED):
            time.sleep(0.05)
        # The next run saves both ranks; the old run's rank 0 is not mixed in.
        h0 = new.save(100, {"w": np.ones(4)}, rank=0, world_size=2, job=job)
        h1 = new.save(100, {"w": np.full(4, 2.0)}, rank=1, world_size=2, job=job)
        h0.wait(30)
        h1.wait(30)
        got0, got1 = new.load(100, rank=0, job=job), new.load(100, rank=1, job=job)
        assert got0.attempt == got1.attempt == "new-run"
        assert list(got0["w"]) == [1.0] * 4 and list(got1["w"]) == [2.0] * 4
        assert [s.attempt for s in new.steps(job)] == ["new-run"]
        # The old run hears that another run committed the step, as a save
        # refused at once would (below): the class, the reason, the winner.
        with pytest.raises(ckptd.AlreadyExistsError, match="new-run") as late:
            h_old.wait(30)
        assert late.value.reason == "STEP_COMMITTED"
        assert late.value.metadata["attempt"] == "new-run"
        assert h_old.status is ckptd.SaveStatus.FAILED
        # A save of the committed step by yet another run is refused, naming it.
        with pytest.raises(ckptd.AlreadyExistsError) as e:
            old.save(100, {"w": np.zeros(4)}, rank=0, world_size=2, job=job)
        assert e.value.reason == "STEP_COMMITTED"
        assert e.value.metadata["attempt"] == "new-run"
