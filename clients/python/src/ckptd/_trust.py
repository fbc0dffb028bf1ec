"""Checks that the daemon behind the socket, and its arena, are the right ones.

A trainer copies its weights into whatever answers on the socket and into
whatever file that daemon names as its arena. Before the first request the
client checks (contracts: who may connect):

- the socket's folder is owned by a trusted uid and is not group- or
  other-writable unless it has the sticky bit (else anyone could replace
  the socket);
- the socket path is a socket (not a link) owned by a trusted uid;
- the process listening on it runs as a trusted uid (SO_PEERCRED);

and before mapping the arena: it is a regular file (opened with
O_NOFOLLOW), owned by the daemon's uid and not world-writable, in a folder
owned by that uid that is not world-writable. Trusted uids are the
client's own, root's, and $CKPTD_DAEMON_UID. A few syscalls, once per
socket (again only when the socket file is replaced) and once per mapping.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass

from ._errors import DaemonUnavailableError, InvalidArgumentError, UntrustedDaemonError

ENV_UID = "CKPTD_DAEMON_UID"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class Peer:
    """A daemon that passed the checks: its socket file and its process's uid."""

    ident: tuple[int, int]  # (st_dev, st_ino) of the socket file checked
    uid: int
    pid: int


def trusted_uids() -> frozenset[int]:
    """The client's own uid, root, and $CKPTD_DAEMON_UID when set.

    Raises:
        InvalidArgumentError: $CKPTD_DAEMON_UID is not a uid.
    """
    uids = {os.geteuid(), 0}
    if env := os.environ.get(ENV_UID):
        if not env.isdigit():
            raise InvalidArgumentError(
                f"${ENV_UID} {env!r} is not a uid: give the numeric uid the daemon runs as"
            )
        uids.add(int(env))
    return frozenset(uids)


def _fix_uid(uid: int) -> str:
    return (
        f"if the daemon of uid {uid} is the one you mean to use, set {ENV_UID}={uid}; "
        "otherwise point CKPTD_SOCKET at your own daemon's socket"
    )


def _trusted_names(trusted: frozenset[int]) -> str:
    return ", ".join(str(u) for u in sorted(trusted))


def check_socket(path: str, trusted: frozenset[int], what: str) -> Peer:
    """Check the socket at path, its folder and the process listening on it.

    Raises:
        UntrustedDaemonError: a check failed; nothing was sent.
        DaemonUnavailableError: nothing is there, or nothing listens.
    """
    folder = os.path.dirname(path) or "."
    try:
        d = os.stat(folder)
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise _absent(what, path, f"{e.filename} does not exist") from None
    if d.st_uid not in trusted:
        raise UntrustedDaemonError(
            f"{what}: refusing the daemon socket {path}: its folder {folder} is owned by uid "
            f"{d.st_uid}, which this client does not trust (trusted uids: "
            f"{_trusted_names(trusted)}), so that user could replace the socket; "
            + _fix_uid(d.st_uid)
        )
    if d.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not d.st_mode & stat.S_ISVTX:
        who = "others" if d.st_mode & stat.S_IWOTH else "its group"
        raise UntrustedDaemonError(
            f"{what}: refusing the daemon socket {path}: its folder {folder} (mode "
            f"{stat.S_IMODE(d.st_mode):04o}, owner uid {d.st_uid}) is writable by {who} without "
            "the sticky bit, so they could replace the socket; make the folder private "
            f"(chmod go-w {folder}) or put the socket in one, such as $XDG_RUNTIME_DIR"
        )
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a socket"
        raise UntrustedDaemonError(
            f"{what}: refusing the daemon socket {path}: it is {kind} (owner uid {st.st_uid}); "
            "point CKPTD_SOCKET (or socket=) at the daemon's socket itself"
        )
    if st.st_uid not in trusted:
        raise UntrustedDaemonError(
            f"{what}: refusing the daemon socket {path}: it is owned by uid {st.st_uid}, which "
            f"this client does not trust (trusted uids: {_trusted_names(trusted)}); "
            + _fix_uid(st.st_uid)
        )
    pid, uid = _peer(path, what)
    if uid not in trusted:
        raise UntrustedDaemonError(
            f"{what}: refusing the daemon on {path}: the process listening there (pid {pid}) "
            f"runs as uid {uid}, which this client does not trust (trusted uids: "
            f"{_trusted_names(trusted)}); " + _fix_uid(uid)
        )
    return Peer((st.st_dev, st.st_ino), uid, pid)


def _peer(path: str, what: str) -> tuple[int, int]:
    """Connect a plain unix socket to path; the listener's (pid, uid)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(_CONNECT_TIMEOUT)
        s.connect(path)
        pid, uid, _ = _UCRED.unpack(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError) as e:
        raise _absent(what, path, str(e)) from None
    finally:
        s.close()
    return pid, uid


def _absent(what: str, path: str, why: str) -> DaemonUnavailableError:
    return DaemonUnavailableError(
        f"{what}: no ckptd daemon answers on {path} ({why}); "
        f"start one with `ckptd serve --socket {path}` or set CKPTD_SOCKET"
    )


def open_arena(path: str, owner: int) -> int:
    """Open the daemon's arena file read-write, refusing one it may not own.

    Returns:
        The descriptor (the caller maps and closes it).

    Raises:
        UntrustedDaemonError: path is a link or not a regular file, it or
            its folder is not owned by owner (the daemon's uid), or either
            is world-writable.
        OSError: the file cannot be opened (not there, no permission).
    """
    folder = os.path.dirname(path) or "."
    d = os.lstat(folder)
    problem = _arena_problem(d, owner, "folder")
    if problem is None and not stat.S_ISDIR(d.st_mode):
        problem = "is not a folder (a symbolic link?)"
    if problem is not None:
        raise _untrusted_arena(path, f"its folder {folder} {problem}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _untrusted_arena(path, "it is a symbolic link") from None
        raise
    st = os.fstat(fd)
    problem = _arena_problem(st, owner, "file")
    if problem is None and not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    if problem is not None:
        os.close(fd)
        raise _untrusted_arena(path, f"it {problem}")
    return fd


def _arena_problem(st: os.stat_result, owner: int, kind: str) -> str | None:
    if st.st_uid != owner:
        return f"is owned by uid {st.st_uid}, not by the daemon's uid {owner}"
    if st.st_mode & stat.S_IWOTH:
        mode = stat.S_IMODE(st.st_mode)
        return f"is world-writable (mode {mode:04o}): any user could change the {kind}"
    return None


def _untrusted_arena(path: str, why: str) -> UntrustedDaemonError:
    return UntrustedDaemonError(
        f"refusing the daemon's arena {path}: {why}; nothing was copied. The arena must be the "
        "daemon's own file in its own folder (ckptd serve --arena-dir): remove what is there "
        "and restart the daemon"
    )
