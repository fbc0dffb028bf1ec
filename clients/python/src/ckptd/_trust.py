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

A socket (or a folder on the way to it) that this user may not use is a
PermissionDeniedError naming its owner, group and mode and the fix
(``--socket-group``), not a bare EACCES.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass

from ._errors import (
    DaemonUnavailableError,
    InvalidArgumentError,
    PermissionDeniedError,
    UntrustedDaemonError,
)

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
        PermissionDeniedError: this user may not enter the socket's folder
            (or one above it) or connect to the socket.
    """
    folder = os.path.dirname(path) or "."
    try:
        d = os.stat(folder)
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise _absent(what, path, f"{e.filename} does not exist") from None
    except PermissionError:
        raise _denied(what, path) from None
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
    except PermissionError:
        raise _denied(what, path) from None
    finally:
        s.close()
    return pid, uid


def _absent(what: str, path: str, why: str) -> DaemonUnavailableError:
    return DaemonUnavailableError(
        f"{what}: no ckptd daemon answers on {path} ({why}); "
        f"start one with `ckptd serve --socket {path}` or set CKPTD_SOCKET"
    )


def _denied(what: str, path: str) -> PermissionDeniedError:
    """Why this user may not reach the socket at path, and the fix.

    The daemon runs but lets in only its user, root and its --socket-group:
    name the owner, group and mode of what stopped us -- the first folder
    on the way that this user may not enter, else the socket itself -- and
    who this user is, as the Go client's accessError does.
    """
    folder = os.path.dirname(path) or "."
    blocked = _unenterable(folder)
    fix = (
        f"you are uid {_user(os.geteuid())}, groups {_groups()}: run as that user, or have "
        "the daemon started with --socket-group naming a group of yours"
    )
    try:
        st = os.stat(path if blocked is None else blocked)
    except OSError:
        return PermissionDeniedError(
            f"{what}: cannot connect to the ckptd socket {path}: permission denied; {fix}"
        )
    owner = (
        f"belongs to uid {_user(st.st_uid)}, group {_group(st.st_gid)}, "
        f"mode {stat.S_IMODE(st.st_mode):04o}"
    )
    if blocked is None:
        return PermissionDeniedError(
            f"{what}: cannot connect to the ckptd socket {path}: permission denied: "
            f"the socket {path} {owner}; {fix}"
        )
    which = "the socket's folder" if blocked == os.path.abspath(folder) else "the folder"
    return PermissionDeniedError(
        f"{what}: cannot reach the ckptd socket {path}: permission denied: {which} "
        f"{blocked} {owner}, and you may not enter it; {fix}. The daemon opens its default "
        "folder (/tmp/ckptd-<uid>) to that group itself; any other folder on the way its "
        f"operator must open to the group too (chgrp GROUP {blocked} && chmod g+x {blocked})"
    )


def _unenterable(folder: str) -> str | None:
    """The topmost folder from / down to folder that this user may not enter, or None."""
    parts = os.path.abspath(folder).split(os.sep)
    effective = os.access in os.supports_effective_ids
    for i in range(1, len(parts) + 1):
        here = os.sep.join(parts[:i]) or os.sep
        if not os.access(here, os.X_OK, effective_ids=effective):
            return here
    return None


def _user(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)  # a uid need not have a name (a container's)


def _group(gid: int) -> str:
    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)


def _groups() -> str:
    """This process's groups, the primary first: those --socket-group can name."""
    gids = dict.fromkeys([os.getegid(), *os.getgroups()])
    return ", ".join(_group(g) for g in gids)


def open_arena(path: str, owner: int, writable: bool = True) -> int:
    """Open the daemon's arena file (read-write, or read-only), refusing one it may not own.

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
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW)
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
