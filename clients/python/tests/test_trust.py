"""The client trusts only the right daemon, and only the right arena (contracts, section 3).

The tests run as root; another user is played by processes that run as
nobody (uid 65534), like a rogue `ckptd serve` waiting on a socket path a
trainer is pointed at.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import ckptd
from ckptd import _trust

NOBODY = 65534
NOBODY_NAME = pwd.getpwuid(NOBODY).pw_name
NOBODY_GROUP = grp.getgrgid(NOBODY).gr_name


@pytest.fixture(autouse=True)
def no_daemon_uid(monkeypatch):
    monkeypatch.delenv("CKPTD_DAEMON_UID", raising=False)


def refused(c: ckptd.Client, match: str) -> ckptd.UntrustedDaemonError:
    """Every kind of call is refused, with the same clear error."""
    for call in (c.steps, lambda: c.save(1, {"a": np.zeros(1)}), lambda: c.load("latest")):
        with pytest.raises(ckptd.UntrustedDaemonError, match=match) as e:
            call()
    return e.value


def test_rogue_daemon_of_another_user_is_refused_before_any_save(make_daemon, job, monkeypatch):
    rogue = make_daemon(user=NOBODY)
    assert os.stat(rogue.socket).st_uid == NOBODY
    with rogue.client() as c:
        err = refused(c, rf"socket {rogue.socket}: it is owned by uid {NOBODY}")
        assert f"CKPTD_DAEMON_UID={NOBODY}" in str(err)  # the fix, if it is the intended one
        assert isinstance(err, ckptd.CkptdError)
    # Naming that uid trusts it: the rogue is a working daemon, so only the
    # check kept the save away from it, and it had received nothing.
    monkeypatch.setenv("CKPTD_DAEMON_UID", str(NOBODY))
    with rogue.client() as c:
        assert c.steps(job) == []
        c.save(1, {"a": np.arange(3)}, job=job).wait(30)
        assert list(c.load(1, job=job)["a"]) == [0, 1, 2]


def test_process_behind_a_trusted_socket_is_checked_by_its_credentials(make_daemon):
    """A root-owned socket file with another user's process listening on it."""
    rogue = make_daemon(user=NOBODY)
    os.chown(rogue.socket, 0, 0)  # passes the owner check; SO_PEERCRED must catch it
    with rogue.client() as c:
        err = refused(c, rf"pid {rogue.proc.pid}\) runs as uid {NOBODY}")
        assert rogue.socket in str(err)


def test_socket_folder_writable_by_others_without_sticky_bit(make_daemon, job):
    d = make_daemon()
    try:
        for mode, who in ((0o777, "others"), (0o770, "its group")):
            os.chmod(d.dir, mode)
            with d.client() as c:
                err = refused(c, f"its folder {d.dir} \\(mode 0{mode:o}, owner uid 0\\)")
                assert f"writable by {who} without the sticky bit" in str(err)
                assert "chmod go-w" in str(err)
        os.chmod(d.dir, 0o1777)  # like /tmp: others cannot replace a file they do not own
        with d.client() as c:
            c.save(1, {"a": np.zeros(1)}, job=job).wait(30)
    finally:
        os.chmod(d.dir, 0o700)


def test_socket_folder_of_another_user(make_daemon):
    d = make_daemon()
    try:
        os.chown(d.dir, NOBODY, NOBODY)
        with d.client() as c:
            refused(c, f"its folder {d.dir} is owned by uid {NOBODY}")
    finally:
        os.chown(d.dir, 0, 0)


def test_socket_path_must_be_the_socket_itself(daemon, tmp_path):
    link = tmp_path / "link.sock"
    link.symlink_to(daemon.socket)
    with ckptd.Client(str(link)) as c:
        refused(c, "it is a symbolic link")
    plain = tmp_path / "plain.sock"
    plain.write_bytes(b"")
    with ckptd.Client(str(plain)) as c:
        refused(c, "it is not a socket")


def test_absent_or_dead_socket_is_no_daemon_not_untrusted(tmp_path):
    with (
        ckptd.Client(str(tmp_path / "absent.sock")) as c,
        pytest.raises(ckptd.DaemonUnavailableError, match="ckptd serve"),
    ):
        c.steps()
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))  # bound, never listening: connections are refused
    with (
        ckptd.Client(str(dead), reconnect_timeout=0) as c,
        pytest.raises(ckptd.DaemonUnavailableError),
    ):
        c.steps()


# What a trainer of another user sees: the class of the error, then its message.
_LIST_STEPS = """
import sys, ckptd
try:
    with ckptd.Client(sys.argv[1], reconnect_timeout=0) as c:
        c.steps()
except ckptd.CkptdError as e:
    print(type(e).__name__, e, sep="\\n")
else:
    print("ok")
"""


def steps_as_nobody(sock: str) -> tuple[str, str]:
    """List steps on sock as uid 65534 (group 65534 only): the error's class and message.

    Through setpriv rather than Popen(user=): setpriv keeps root's
    capabilities until the exec, so an interpreter installed under a
    folder only root may enter (/root here) still starts.
    """
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    out = subprocess.run(
        [*drop, sys.executable, "-c", _LIST_STEPS, sock],
        env={**os.environ, "HOME": "/"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    kind, _, message = out.stdout.strip().partition("\n")
    return kind, message


@pytest.mark.parametrize(("extra", "mode"), [((), 0o600), (("--socket-group", "0"), 0o660)])
def test_socket_another_user_may_not_use_names_its_owner_and_the_fix(make_daemon, extra, mode):
    d = make_daemon(*extra)
    os.chmod(d.dir, 0o755)  # the folder lets everyone in; the socket does not
    kind, message = steps_as_nobody(d.socket)
    assert kind == "PermissionDeniedError", message
    assert f"cannot connect to the ckptd socket {d.socket}: permission denied" in message
    assert (
        f"the socket {d.socket} belongs to uid 0 (root), group 0 (root), mode {mode:04o}" in message
    )
    assert f"you are uid {NOBODY} ({NOBODY_NAME}), groups {NOBODY} ({NOBODY_GROUP})" in message
    assert "have the daemon started with --socket-group naming a group of yours" in message


def test_socket_group_named_by_the_message_lets_that_user_in(make_daemon):
    d = make_daemon("--socket-group", str(NOBODY))
    os.chmod(d.dir, 0o755)
    assert steps_as_nobody(d.socket) == ("ok", "")


# The modes the daemon gives its own /tmp/ckptd-<uid>: alone, and with --socket-group.
@pytest.mark.parametrize("mode", [0o700, 0o750])
def test_socket_folder_another_user_may_not_enter_is_named(make_daemon, mode):
    d = make_daemon()
    os.chmod(d.dir, mode)
    kind, message = steps_as_nobody(d.socket)
    assert kind == "PermissionDeniedError", message
    assert f"cannot reach the ckptd socket {d.socket}: permission denied" in message
    assert (
        f"the socket's folder {d.dir} belongs to uid 0 (root), group 0 (root), mode {mode:04o}, "
        "and you may not enter it"
    ) in message
    assert f"you are uid {NOBODY} ({NOBODY_NAME})" in message
    assert "--socket-group naming a group of yours" in message
    assert f"chmod g+x {d.dir}" in message


def test_daemon_uid_must_be_a_number(monkeypatch):
    monkeypatch.setenv("CKPTD_DAEMON_UID", "nobody")
    with pytest.raises(ckptd.InvalidArgumentError, match=r"\$CKPTD_DAEMON_UID 'nobody'"):
        ckptd.Client("/nonexistent.sock")


def arena_refused(d, job: str, match: str) -> None:
    with d.client() as c:
        with pytest.raises(ckptd.UntrustedDaemonError, match=match) as e:
            c.save(1, {"a": np.zeros(1)}, job=job)
        assert "nothing was copied" in str(e.value)
        assert c.transport == "auto"  # refused, not quietly streamed instead
        assert c.steps(job) == []


def test_arena_that_is_a_symlink_is_refused(make_daemon, job):
    d = make_daemon()
    arena = d.arena_dir / "arena"
    arena.rename(d.arena_dir / "elsewhere")  # the daemon keeps its own mapping
    arena.symlink_to(d.arena_dir / "elsewhere")
    arena_refused(d, job, f"arena {arena}: it is a symbolic link")


def test_arena_others_could_change_is_refused(make_daemon, job):
    d = make_daemon()
    arena = d.arena_dir / "arena"
    mode = arena.stat().st_mode
    arena.chmod(0o666)
    arena_refused(d, job, r"it is world-writable \(mode 0666\)")
    arena.chmod(mode)
    os.chown(arena, NOBODY, NOBODY)
    arena_refused(d, job, f"it is owned by uid {NOBODY}, not by the daemon's uid 0")
    os.chown(arena, 0, 0)
    os.chmod(d.arena_dir, 0o777)
    arena_refused(d, job, f"its folder {d.arena_dir} is world-writable")
    os.chmod(d.arena_dir, 0o700)
    with d.client() as c:  # all put back: accepted
        c.save(1, {"a": np.zeros(1)}, job=job).wait(30)


def test_checks_run_once_per_daemon_and_stay_cheap(make_daemon, job, monkeypatch):
    d = make_daemon()
    checks = []
    real = _trust.check_socket

    def counted(*a):
        checks.append(time.perf_counter())
        return real(*a)

    monkeypatch.setattr(_trust, "check_socket", counted)
    with d.client() as c:
        for i in range(5):
            c.save(i, {"a": np.zeros(1)}, job=job).wait(30)
            c.load(i, job=job)
        assert len(checks) == 1  # once for the client, not per call
        t0 = time.perf_counter()
        for _ in range(1000):
            c._conn.ensure_trusted("bench")
        assert time.perf_counter() - t0 < 1.0  # one lstat each (microseconds)
        t0 = time.perf_counter()
        real(d.socket, c._conn.trusted_uids, "bench")
        assert time.perf_counter() - t0 < 0.5  # the full checks: a few syscalls
        d.stop()
        d.start()  # a new socket file: checked again before use
        checks.clear()  # start() made clients of its own
        c.steps(job)
        c.steps(job)
        assert len(checks) == 1


def test_stream_transport_is_checked_too(make_daemon, job):
    rogue = make_daemon(user=NOBODY)
    with rogue.client(transport="stream") as c:
        with pytest.raises(ckptd.UntrustedDaemonError):
            c.save(1, {"a": np.zeros(1)}, job=job)
        with pytest.raises(ckptd.UntrustedDaemonError):
            c.load(1, job=job)
