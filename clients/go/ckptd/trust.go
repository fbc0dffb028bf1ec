//go:build linux

package ckptd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// ErrUntrustedDaemon: the socket, the process answering on it, or the
// arena it names is not what a daemon of a trusted user would have made.
// Nothing was sent to it.
var ErrUntrustedDaemon = errors.New("untrusted ckptd daemon")

// trustedUIDs are the users whose daemon the client talks to: its own,
// root, and $CKPTD_DAEMON_UID (a daemon run by a service account).
func trustedUIDs() []int {
	uids := []int{os.Getuid(), 0}
	if s := os.Getenv("CKPTD_DAEMON_UID"); s != "" {
		if uid, err := strconv.Atoi(s); err == nil && uid >= 0 {
			uids = append(uids, uid)
		}
	}
	return uids
}

// checkSocketPath refuses a socket that another user could have put in
// place: it must be a socket owned by a trusted user, in a folder owned by
// a trusted user that others cannot write into (or, like /tmp, that has
// the sticky bit, so they cannot replace what is ours).
func checkSocketPath(path string, trusted []int) error {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); errors.Is(err, unix.EACCES) {
		return folderError(path, fmt.Errorf("ckptd socket %s: %w", path, err))
	} else if err != nil {
		return fmt.Errorf("ckptd socket %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("%w: %s is not a socket; remove it and start ckptd serve", ErrUntrustedDaemon, path)
	}
	if !slices.Contains(trusted, int(st.Uid)) {
		return fmt.Errorf("%w: the socket %s belongs to uid %d, not to you or root; another user may be impersonating the daemon. "+
			"Set CKPTD_DAEMON_UID=%d if that user runs your daemon", ErrUntrustedDaemon, path, st.Uid, st.Uid)
	}
	dir := filepath.Dir(path)
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("ckptd socket folder %s: %w", dir, err)
	}
	if !slices.Contains(trusted, int(st.Uid)) {
		return fmt.Errorf("%w: the socket's folder %s belongs to uid %d; another user could replace the socket", ErrUntrustedDaemon, dir, st.Uid)
	}
	if st.Mode&0o022 != 0 && st.Mode&unix.S_ISVTX == 0 {
		return fmt.Errorf("%w: the socket's folder %s is writable by others (mode %o) without the sticky bit; another user could replace the socket",
			ErrUntrustedDaemon, dir, st.Mode&0o7777)
	}
	return nil
}

// peerUID returns the uid of the process on the other end of c.
func peerUID(c *net.UnixConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if serr != nil {
		return 0, serr
	}
	return int(cred.Uid), nil
}

// dialer connects to the daemon's socket after checking it, and checks
// the credentials of the process that accepted, so that a squatted socket
// gets no request at all. It remembers the daemon's uid for the arena
// check.
type dialer struct {
	socket    string
	daemonUID atomic.Int64 // -1 until a connection succeeded
	refused   atomic.Pointer[error]
}

func (d *dialer) dial(ctx context.Context, _ string) (c net.Conn, err error) {
	defer func() {
		if errors.Is(err, ErrUntrustedDaemon) {
			d.refused.Store(&err)
		} else if err == nil {
			d.refused.Store(nil)
		}
	}()
	trusted := trustedUIDs()
	if err := checkSocketPath(d.socket, trusted); err != nil {
		return nil, err
	}
	var nd net.Dialer
	c, err = nd.DialContext(ctx, "unix", d.socket)
	if errors.Is(err, unix.EACCES) {
		return nil, accessError(d.socket, err)
	}
	if err != nil {
		return nil, err
	}
	uid, err := peerUID(c.(*net.UnixConn))
	if err == nil && !slices.Contains(trusted, uid) {
		err = fmt.Errorf("%w: the process answering on %s runs as uid %d, not as you or root; "+
			"set CKPTD_DAEMON_UID=%d if that user runs your daemon", ErrUntrustedDaemon, d.socket, uid, uid)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	d.daemonUID.Store(int64(uid))
	return c, nil
}

// refusal returns why the last connection attempt refused the daemon, if
// it did: gRPC reports a failed dial as UNAVAILABLE, and callers should
// see ErrUntrustedDaemon instead.
func (d *dialer) refusal() error {
	if p := d.refused.Load(); p != nil {
		return *p
	}
	return nil
}

// accessError says why the socket refused us and what fixes it: the
// daemon runs, but lets in only its user, root and one group.
func accessError(socket string, err error) error {
	var st unix.Stat_t
	if e := unix.Stat(socket, &st); errors.Is(e, unix.EACCES) {
		return folderError(socket, err)
	} else if e != nil {
		return err
	}
	return fmt.Errorf("%w: the socket %s belongs to uid %d, group %d, mode %o; you are uid %d: "+
		"run as that user, or have the daemon started with --socket-group naming a group of yours (%d, or a supplementary one)",
		err, socket, st.Uid, st.Gid, st.Mode&0o777, os.Getuid(), os.Getgid())
}

// folderError explains a socket we cannot even look at: a folder above it
// that we may not enter. The daemon makes its socket's folder 0700 (0750
// and of the group with --socket-group), so this is what a user outside
// that group meets first.
func folderError(socket string, err error) error {
	dir, st, ok := closedFolder(socket)
	if !ok {
		return err
	}
	return fmt.Errorf("%w: the socket's folder %s belongs to uid %d, group %d, mode %o, and you (uid %d) may not enter it: "+
		"run as that user, or have the daemon started with --socket-group naming a group of yours (%d, or a supplementary one), "+
		"which opens the folder and the socket to that group",
		err, dir, st.Uid, st.Gid, st.Mode&0o7777, os.Getuid(), os.Getgid())
}

// closedFolder finds the first folder from the root down to path's that
// we may not enter (search, as the effective user).
func closedFolder(path string) (string, unix.Stat_t, bool) {
	var dirs []string // path's folder and those above it, innermost first
	for d := filepath.Dir(path); ; d = filepath.Dir(d) {
		dirs = append(dirs, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	var st unix.Stat_t
	for _, d := range slices.Backward(dirs) {
		if errors.Is(unix.Faccessat(unix.AT_FDCWD, d, unix.X_OK, unix.AT_EACCESS), unix.EACCES) {
			return d, st, unix.Stat(d, &st) == nil
		}
	}
	return "", st, false
}
