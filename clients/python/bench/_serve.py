"""A `ckptd serve` for the benchmarks: temporary socket and arena, stopped after."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import ckptd

_PIDS: dict[str, int] = {}  # socket -> the pid of the daemon serving it


def pid_of(sock: str) -> int:
    """The pid of the daemon serve() started on sock (for its CPU time)."""
    return _PIDS[sock]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a running process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(binary: str, name: str, *args: str) -> Iterator[str]:
    """Start `binary serve` with args plus its own socket and arena; yield the socket."""
    tmp = Path(tempfile.mkdtemp(prefix=f"ckptd-{name}-"))
    sock = str(tmp / "ckptd.sock")
    arena = f"/dev/shm/ckptd-{name}-{os.getpid()}"
    log = open(tmp / "ckptd.log", "wb")  # noqa: SIM115 - closed below
    cmd = [binary, "serve", "--socket", sock, "--arena-dir", arena, "--job", "bench", *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(sock, proc, tmp / "ckptd.log")
        _PIDS[sock] = proc.pid
        yield sock
    finally:
        _PIDS.pop(sock, None)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        log.close()
        shutil.rmtree(arena, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_log(sock: str, text: str, timeout: float = 300) -> float:
    """Wait until the log of the daemon serve() started on sock says text; the seconds waited."""
    log = Path(sock).parent / "ckptd.log"
    t0 = time.monotonic()
    while text not in log.read_text(errors="replace"):
        if time.monotonic() - t0 > timeout:
            sys.exit(f"ckptd serve did not log {text!r} in {timeout:.0f}s:\n{log.read_text()}")
        time.sleep(0.01)
    return time.monotonic() - t0


def _wait_ready(sock: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with ckptd.Client(sock, timeout=2) as c:
                c.steps()
            return
        except ckptd.DaemonUnavailableError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"ckptd serve did not start:\n{log.read_text()}")
            time.sleep(0.05)
