"""The test session's reaper: what a killed pytest leaves, it removes.

Started once per session (conftest), in a session of its own, with the
prefix of every arena folder the session's daemons use. It waits for a byte
on its standard input, which pytest writes as it ends, or for the input to
close, which happens when pytest dies however it dies (a kill -9 too, once
the processes forked from it are gone). Then it kills every process whose
command line names the prefix (the session's daemons) and removes the
folders.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys
import time


def daemons(prefix: bytes) -> list[int]:
    """The pids, other than ours, whose command line holds prefix."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if prefix in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def main() -> None:
    prefix = sys.argv[1]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.stdin.buffer.read(1)  # until pytest says it ends, or is gone (EOF)
    for pid in daemons(prefix.encode()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    for path in glob.glob(glob.escape(prefix) + "*"):
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
