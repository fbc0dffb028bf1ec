"""ckptd.dcp's rank 0 rides out a daemon that is away, as every other rank does.

Four gloo processes (dcp_outage_worker.py) save an FSDP2 model through
ckptd.dcp while this test stops, kills and starts their real daemon at the
points the worker's docstring lists: before the daemon is up, between rank
0's staging and its commit (dcp.save and dcp.async_save), and when
async_save is called. Every committed step is loaded back bit for bit.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from launch import run_ranks
from slow import scaled

WORKER = Path(__file__).with_name("dcp_outage_worker.py")
WORLD = 4


class Ranks:
    """The worker's ranks, run in a thread while the test handles the daemon."""

    def __init__(self, socket: str, job: str, out: Path, last: int) -> None:
        self.out = out
        self.error: BaseException | None = None
        args = [str(WORLD), str(out / "store"), socket, job, str(out), str(last)]

        def run() -> None:
            try:
                run_ranks(lambda r: [str(WORKER), str(r), *args], WORLD, "dcp outage", 900)
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def wait_for(self, name: str) -> None:
        """Wait for a rank's marker file (or for the ranks to fail)."""
        until((self.out / name).exists, f"{name} from the ranks", self)

    def mark(self, name: str) -> None:
        (self.out / name).write_text("")

    def report(self) -> dict[str, dict]:
        self.thread.join(scaled(900))
        if self.error is not None:
            raise self.error
        return json.loads((self.out / "report.json").read_text())


def until(cond: Callable[[], bool], what: str, ranks: Ranks) -> None:
    """Wait for cond, up to a deadline; fail at once if the ranks have ended."""
    limit = scaled(600)
    deadline = time.monotonic() + limit
    while not cond():
        if not ranks.thread.is_alive():
            pytest.fail(f"the ranks ended before {what}: {ranks.error}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {limit:.0f}s")
        time.sleep(0.02)


def journal_empty(d) -> bool:
    """Whether the daemon's journal holds no save (every staged one is durable)."""
    return not [p for p in (d.arena_dir / "journal").iterdir() if p.is_file()]


@pytest.mark.parametrize("how", ["stop", "kill9"])
def test_rank_0_rides_out_a_daemon_away_or_restarted(make_daemon, job, tmp_path, how):
    d = make_daemon()
    d.stop()  # not up when the ranks start
    ranks = Ranks(d.socket, job, tmp_path, 5 if how == "kill9" else 4)
    ranks.wait_for("waiting-1")  # rank 0's dcp.save found no daemon, and waits
    d.start()
    for n in (2, 3):  # rank 0's shard is staged, not committed
        if n == 3:
            ranks.wait_for("ready-3")
            ranks.mark("set-3")
        ranks.wait_for(f"staged-{n}")
        if how == "kill9":  # a crash with nothing journaled: the successor makes a new arena
            until(lambda: journal_empty(d), "empty journal", ranks)
        getattr(d, how)()
        d.start()
        ranks.mark(f"go-{n}")
    ranks.wait_for("ready-4")
    d.stop()
    ranks.mark("set-4")
    ranks.wait_for("waiting-4")  # rank 0's async_save staging found no daemon
    d.start()
    if how == "kill9":
        ranks.wait_for("ready-5")
        d.stop()
        d.start("--debug-drain-delay", "1h")  # the other ranks' shards stay journaled
        ranks.mark("set-5")
        ranks.wait_for("staged-5")
        d.kill9()
        d.start()  # replays the journal: the arena file is reused
        ranks.mark("go-5")
    report = ranks.report()

    assert report["1"] == {"error": None, "copies": 1, "diff": []}
    # dcp.save: the lease died with the daemon; the shard is made again from the state.
    assert report["2"] == {"error": None, "copies": 2, "diff": []}
    # async_save: the old arena file went with the daemon, so the region's
    # bytes were rank 0's alone: the shard is made again from them (the
    # trainer's tensors have changed since), and holds the staged values.
    assert report["3"] == {"error": None, "copies": 2, "diff": []}
    assert report["4"] == {"error": None, "copies": 1, "diff": []}
    if how == "kill9":
        # The successor reused the arena (it held journaled saves), and may
        # hand the region on: the save fails, saying why and what to do.
        r5 = report["5"]
        assert r5["diff"] is None and r5["copies"] == 1, r5
        assert "the staged copy was lost" in r5["error"], r5
        assert "Save a later step" in r5["error"], r5
