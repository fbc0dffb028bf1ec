"""Fixtures: a real `ckptd serve`, built from this repository once per session.

Each daemon gets its own socket, storage folder and arena under /dev/shm
(removed afterwards; by the reaper, reaper.py, if pytest dies first). Under
CI a skipped test fails: CI must run them all, torch tests included.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from slow import scaled

import ckptd

REPO = Path(__file__).resolve().parents[3]
_counter = itertools.count()

# Every arena folder of this session's daemons begins so; the reaper kills
# the daemons and removes the folders once pytest is gone.
ARENA_PREFIX = f"/dev/shm/ckptd-pytest-{os.getpid()}-"
_reaper: list[subprocess.Popen[bytes]] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _sweep_dead_arenas()
    _reaper[:] = [subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("reaper.py")), ARENA_PREFIX],
        stdin=subprocess.PIPE, start_new_session=True,
    )]  # fmt: skip


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for r in _reaper:
        if r.stdin is not None:
            # A byte, not only EOF: a process forked from pytest and still
            # alive (a DataLoader worker a failed test left) holds the pipe.
            r.stdin.write(b"x")
            r.stdin.close()
        r.wait()


def _sweep_dead_arenas() -> None:
    """Remove the arenas of earlier sessions that are gone, reaper and all."""
    for entry in Path("/dev/shm").glob("ckptd-pytest-*-*"):
        pid = entry.name.split("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module skipped as it is collected (pytest.importorskip at its top)
    # reports no test at all: under CI that is a failure too.
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("CI") and rep.outcome == "skipped":
        rep.outcome = "failed"
        rep.longrepr = f"skipped at collection under CI, which must run every test: {rep.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("CI") and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"skipped under CI, which must run every test: {rep.longrepr}"


# What ckptd reads to tell this process's rank (ckptd/_ranks.py): cleared for
# every test, so that a suite run under a launcher still runs as one process.
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def ckptd_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ckptd binary: $CKPTD_TEST_BIN (make builds it), else built from the repository."""
    if given := os.environ.get("CKPTD_TEST_BIN"):
        return Path(given)
    out = tmp_path_factory.mktemp("bin") / "ckptd"
    build = subprocess.run(
        ["go", "build", "-o", str(out), "./cmd/ckptd"], cwd=REPO, capture_output=True, text=True
    )
    if build.returncode != 0:
        pytest.fail(f"go build ./cmd/ckptd failed:\n{build.stderr}")
    return out


class Daemon:
    """A running `ckptd serve` with its own socket, storage and arena.

    With user, it runs as that uid and gid (no other groups), as another
    user's daemon would: its folder is then world-writable with the sticky
    bit (like /tmp), and its storage and binary that user's.
    """

    def __init__(
        self,
        binary: Path,
        *extra: str,
        staging: str = "256MiB",
        job: str = "pytest",
        user: int | None = None,
    ) -> None:
        # A short folder under /tmp: unix socket paths are limited to 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="ckptd-py-"))
        self.socket = str(self.dir / "ckptd.sock")
        self.storage = self.dir / "store"
        self.arena_dir = Path(f"{ARENA_PREFIX}{next(_counter)}")
        self.user = user
        if user is not None:
            os.chmod(self.dir, 0o1777)
            self.storage.mkdir()
            os.chown(self.storage, user, user)
            binary = Path(shutil.copy(binary, self.dir / "ckptd"))  # theirs may be private
            os.chmod(binary, 0o755)
        self.args = [
            str(binary), "serve", "--socket", self.socket, "--storage", str(self.storage),
            "--arena-dir", str(self.arena_dir), "--staging-bytes", staging, "--job", job,
            "--workers", "2", "--dataset-allow", f"{tempfile.gettempdir()},s3://bucket",
            # Allowed an S3 source, a daemon takes --cache-bytes (1 GiB) at
            # start: hundreds of test daemons would take it for nothing.
            # test_dataset_s3.py's daemons take it, as by default.
            "--cache-memory-at-start=false", *extra,
        ]  # fmt: skip
        self.log = self.dir / "ckptd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, *extra: str) -> None:
        as_user = {}
        if self.user is not None:
            as_user = {"user": self.user, "group": self.user, "extra_groups": []}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.args, *extra], stdout=log, stderr=subprocess.STDOUT, **as_user
            )
        limit = scaled(60)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"ckptd serve exited early ({self.proc.returncode}):\n{self.logs()}")
            if self._ready():
                return
            time.sleep(0.05)
        pytest.fail(f"ckptd serve not ready after {limit:.0f}s:\n{self.logs()}")

    def _ready(self) -> bool:
        if self.user is not None:  # a client would (rightly) refuse it: just connect
            with socket.socket(socket.AF_UNIX) as s:
                return s.connect_ex(self.socket) == 0
        try:
            with ckptd.Client(self.socket, timeout=scaled(2), reconnect_timeout=0) as c:
                c.steps()
        except ckptd.DaemonUnavailableError:
            return False
        return True

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM, as an operator would; the daemon drains and exits."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        limit = scaled(120)
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"ckptd serve ignored SIGTERM for {limit:.0f}s:\n{self.logs()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def client(self, **kw: object) -> ckptd.Client:
        return ckptd.Client(self.socket, **kw)  # type: ignore[arg-type]

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.arena_dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon(ckptd_bin: Path) -> Iterator[Daemon]:
    """One daemon shared by the tests that need nothing special of it."""
    d = Daemon(ckptd_bin)
    yield d
    d.cleanup()


@pytest.fixture(scope="module")
def dataset_daemon(ckptd_bin: Path) -> Iterator[Daemon]:
    """A daemon for dataset tests, with small ring slots so batches fill many of them."""
    d = Daemon(ckptd_bin, "--slot-bytes", "256KiB", "--ring-slots", "3")
    yield d
    d.cleanup()


@pytest.fixture
def make_daemon(ckptd_bin: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons with extra flags; each is stopped after the test."""
    started: list[Daemon] = []

    def make(*extra: str, staging: str = "256MiB", user: int | None = None) -> Daemon:
        d = Daemon(ckptd_bin, *extra, staging=staging, user=user)
        started.append(d)
        return d

    yield make
    for d in started:
        d.cleanup()


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job name of its own for each test, so steps never collide."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:200]
    return f"{name}-{next(_counter)}"


@pytest.fixture
def client(daemon: Daemon) -> Iterator[ckptd.Client]:
    with daemon.client() as c:
        yield c
