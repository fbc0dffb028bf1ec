package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/internal/arena"
)

// DefaultSocket is the unix socket `ckptd serve` listens on, and clients
// connect to, when none is given:
//
//  1. $CKPTD_SOCKET, when set (not empty);
//  2. else $XDG_RUNTIME_DIR/ckptd.sock, when XDG_RUNTIME_DIR is set (not
//     empty): the user's private runtime folder, /run/user/<uid> under
//     systemd;
//  3. else /tmp/ckptd-<uid>/ckptd.sock, <uid> being the real uid in
//     decimal. The folder is /tmp itself, not $TMPDIR, so that a daemon and
//     a trainer with different TMPDIRs still meet.
//
// The Go client (clients/go/ckptd) and the Python client (ckptd) apply the
// same rule; change the three together. serve refuses a default socket
// folder that is a symbolic link, owned by another uid, or writable by
// group or others, and in case 3 creates it (0700; 0750 and of the group
// with --socket-group), so that another local user cannot have prepared
// it to capture the trainers' connections.
func DefaultSocket() string {
	if s := os.Getenv("CKPTD_SOCKET"); s != "" {
		return s
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "ckptd.sock")
	}
	return filepath.Join(tmpRoot, fmt.Sprintf("ckptd-%d", os.Getuid()), "ckptd.sock")
}

// tmpRoot is /tmp; tests point it elsewhere.
var tmpRoot = "/tmp"

// maxSocketPath is the longest path a unix socket address holds (sun_path
// is 108 bytes with its terminating NUL).
const maxSocketPath = 107

// socketPlace is where serve's socket goes and what serve may do there.
type socketPlace struct {
	path string // absolute
	dir  string
	// private: dir is ours and nobody else may write in it, so a file we
	// left there (the arena pointer) is one we wrote.
	private bool
	madeDir string // the topmost folder this start created, "" if none
}

// prepareSocket resolves --socket (flag; "" for DefaultSocket) and makes
// sure its folder is fit for it, creating the folder if needed. Nothing is
// bound yet.
func prepareSocket(flag string, gid int, log *slog.Logger) (*socketPlace, error) {
	path, inTmp, inXDG := flag, false, false // inTmp, inXDG: rule 3 or 2 of DefaultSocket
	if path == "" {
		path = DefaultSocket()
		if os.Getenv("CKPTD_SOCKET") == "" {
			inXDG = os.Getenv("XDG_RUNTIME_DIR") != ""
			inTmp = !inXDG
		}
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, UsageError{fmt.Errorf("--socket %q: %w", path, err)}
	}
	if len(abs) > maxSocketPath {
		return nil, UsageError{fmt.Errorf("socket path %s is %d bytes long; a unix socket path holds at most %d: pass a shorter --socket",
			abs, len(abs), maxSocketPath)}
	}
	sp := &socketPlace{path: abs, dir: filepath.Dir(abs)}
	switch {
	case inTmp: // /tmp/ckptd-<uid>: ours to create and to keep private
		made, err := ensurePrivateDir(sp.dir, gid)
		if err != nil {
			return nil, err
		}
		if made {
			sp.madeDir = sp.dir
		}
	case inXDG: // $XDG_RUNTIME_DIR: the session's, not ours to create or change
		if _, err := checkPrivateDir(sp.dir, false); err != nil {
			return nil, fmt.Errorf("%w (from XDG_RUNTIME_DIR; unset it, or pass --socket)", err)
		}
		if gid >= 0 {
			log.Warn("--socket-group with the default socket in XDG_RUNTIME_DIR: members of the group can "+
				"connect only if they may enter that folder (usually 0700); pass --socket in a folder they can enter",
				"folder", sp.dir)
		}
	default: // an explicit path: the operator's folder, created as before if missing
		if sp.madeDir, err = mkdirAllTracked(sp.dir, 0o755); err != nil {
			return nil, fmt.Errorf("socket folder: %w", err)
		}
		if fi, err := os.Stat(sp.dir); err == nil && fi.Mode().Perm()&0o022 != 0 && fi.Mode()&os.ModeSticky == 0 {
			log.Warn("the socket's folder is writable by group or others, who could replace the socket; "+
				"clients will refuse it: use a folder only you can write", "folder", sp.dir, "mode", fi.Mode().String())
		}
	}
	_, err = checkPrivateDir(sp.dir, false)
	sp.private = err == nil
	return sp, nil
}

// undo removes the socket folders this start created, those still empty.
func (sp *socketPlace) undo() {
	if sp.madeDir == "" {
		return
	}
	for d := sp.dir; ; d = filepath.Dir(d) {
		_ = os.Remove(d) // fails, rightly, if anything is left in it
		if d == sp.madeDir || d == filepath.Dir(d) {
			return
		}
	}
}

// mkdirAllTracked is os.MkdirAll that returns the topmost folder it
// created ("" if dir existed).
func mkdirAllTracked(dir string, mode os.FileMode) (string, error) {
	top := ""
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || d == filepath.Dir(d) {
			break
		}
		top = d
	}
	if top == "" {
		return "", nil
	}
	return top, os.MkdirAll(dir, mode)
}

// ensurePrivateDir creates dir 0700 (0750 and of group gid when gid >= 0),
// or checks that an existing one is fit (checkPrivateDir) and sets those
// modes. It reports whether it created dir.
func ensurePrivateDir(dir string, gid int) (made bool, err error) {
	err = os.Mkdir(dir, 0o700)
	made = err == nil
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return false, fmt.Errorf("socket folder: %w", err)
	}
	defer func() {
		if err != nil && made {
			os.Remove(dir)
		}
	}()
	f, err := checkPrivateDir(dir, true)
	if err != nil {
		return made, err
	}
	defer f.Close()
	mode := os.FileMode(0o700)
	if gid >= 0 {
		if err := f.Chown(-1, gid); err != nil { // the group before the mode
			return made, fmt.Errorf("socket folder %s: --socket-group: %w", dir, err)
		}
		mode = 0o750
	}
	if err := f.Chmod(mode); err != nil {
		return made, fmt.Errorf("socket folder %s: %w", dir, err)
	}
	return made, nil
}

// checkPrivateDir opens dir, refusing it unless it is a real folder (not
// a symbolic link) owned by our uid that neither group nor others may
// write: in such a folder nobody else can swap the socket for their own.
// The errors name the owner and the fix. With keep, the open folder is
// returned for the caller to change through (and close).
func checkPrivateDir(dir string, keep bool) (*os.File, error) {
	fix := "remove it (as root or its owner), or pass --socket PATH in a folder only you can write"
	f, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW, 0)
	switch {
	case errors.Is(err, syscall.ELOOP), errors.Is(err, syscall.ENOTDIR):
		if target, lerr := os.Readlink(dir); lerr == nil {
			return nil, fmt.Errorf("socket folder %s is a symbolic link (to %s), which another user may have planted "+
				"to capture the socket; refusing it: %s", dir, target, fix)
		}
		return nil, fmt.Errorf("socket folder %s is not a folder; %s", dir, fix)
	case err != nil:
		return nil, fmt.Errorf("socket folder: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, fmt.Errorf("socket folder %s: %w", dir, err)
	}
	switch {
	case int(st.Uid) != os.Geteuid():
		err = fmt.Errorf("socket folder %s is owned by uid %d%s, not by uid %d that ckptd runs as: another user "+
			"may have created it to capture the socket; refusing it: %s", dir, st.Uid, userName(st.Uid), os.Geteuid(), fix)
	case st.Mode&0o022 != 0:
		err = fmt.Errorf("socket folder %s is writable by group or others (mode %04o), who could replace the socket; "+
			"refusing it: run chmod go-w %s, or pass --socket PATH in a folder only you can write", dir, st.Mode&0o7777, dir)
	}
	if err != nil || !keep {
		f.Close()
		return nil, err
	}
	return f, nil
}

// userName is " (name)" for uid, or "" when it has none.
func userName(uid uint32) string {
	if u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10)); err == nil {
		return " (" + u.Username + ")"
	}
	return ""
}

// probeSocket tells whether something listens on the unix socket path,
// and if so the pid that listens (from SO_PEERCRED; 0 when it is not
// visible in our pid namespace or cannot be known).
func probeSocket(path string) (live bool, pid int, err error) {
	c, err := net.DialTimeout("unix", path, time.Second)
	switch {
	case err == nil:
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, fs.ErrNotExist):
		return false, 0, nil // nobody listens: a dead daemon's socket, or none
	case errors.Is(err, syscall.EAGAIN), os.IsTimeout(err):
		return true, 0, nil // a listener whose backlog is full: alive, if busy
	default:
		return false, 0, fmt.Errorf("cannot tell whether a daemon serves on %s: %w", path, err)
	}
	defer c.Close()
	raw, err := c.(*net.UnixConn).SyscallConn()
	if err != nil {
		return true, 0, nil
	}
	_ = raw.Control(func(fd uintptr) {
		if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			pid = int(cred.Pid)
		}
	})
	return true, pid, nil
}

// waitSocketFree returns once nothing listens on path. A listener that is
// running is another daemon: an error at once. One that is exiting (a
// daemon killed a moment ago keeps its socket open until its memory is
// unmapped) or that we cannot see (another pid namespace) is waited for,
// for up to wait.
func waitSocketFree(ctx context.Context, path string, wait time.Duration, log *slog.Logger) error {
	start := time.Now()
	var logged time.Time
	for {
		live, pid, err := probeSocket(path)
		if err != nil || !live {
			if err == nil && !logged.IsZero() {
				log.Info("socket released", "socket", path, "waited", time.Since(start).Round(time.Millisecond))
			}
			return err
		}
		state, comm := arena.InspectProcess(pid)
		waited := time.Since(start)
		switch {
		case state == arena.ProcRunning:
			return fmt.Errorf("another process (pid %d, %s) is already serving on %s: stop it first, or give this "+
				"daemon another --socket", pid, comm, path)
		case waited >= wait:
			return fmt.Errorf("%s is still held by pid %d (%s) after waiting %s for it to exit; raise --restart-wait "+
				"if that process is a daemon that takes longer to exit", path, pid, state, waited.Round(time.Millisecond))
		case time.Since(logged) >= 5*time.Second:
			logged = time.Now()
			log.Warn("waiting for the previous daemon, which is not running any more, to release the socket",
				"socket", path, "pid", pid, "state", state.String(), "waited", waited.Round(time.Millisecond), "limit", wait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// listenUnix listens on path, replacing a stale socket file left by a dead
// daemon but never one that a live daemon answers on, nor anything that is
// not a socket. Only the owner (and group gid, unless -1) may connect:
// that is the access control.
//
// The socket is bound in a fresh private folder next to path, narrowed to
// 0600 (0660 of group gid) there, and renamed into place. bind creates
// the socket file with the process umask, which is process-wide: setting
// a tighter one around bind would race with every other goroutine creating
// files, and a lock around it would bind only the code that takes it (not
// grpc, minio or the runtime). In a 0700 folder that nobody else can enter,
// the mode the umask gave does not matter, and at path the socket is
// never more open than asked, nor widened after.
//
// The check for a live daemon, the removal of a stale socket and the
// rename happen under an flock of the folder, so that two daemons starting
// at once on one path cannot both find it stale and replace each other's.
// The rename also refuses to replace anything (RENAME_NOREPLACE).
func listenUnix(path string, gid int) (net.Listener, error) {
	dir := filepath.Dir(path)
	tmp, err := os.MkdirTemp(dir, ".ckptd-bind-")
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	defer os.RemoveAll(tmp)
	bound := filepath.Join(tmp, "s")
	lis, err := bindUnix(tmp, bound)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	lis.SetUnlinkOnClose(false) // it would unlink the temporary name; Close removes path
	mode := os.FileMode(0o600)
	if gid >= 0 {
		if err := os.Lchown(bound, -1, gid); err != nil {
			lis.Close()
			return nil, fmt.Errorf("--socket-group: %w", err)
		}
		mode = 0o660
	}
	if err := os.Chmod(bound, mode); err != nil {
		lis.Close()
		return nil, err
	}
	l := &unixListener{UnixListener: lis, path: path}
	err = withDirLock(dir, func() error {
		if live, pid, err := probeSocket(path); err != nil {
			return err
		} else if live {
			return fmt.Errorf("another process (pid %d) is already serving on %s", pid, path)
		}
		if fi, err := os.Lstat(path); err == nil {
			if fi.Mode()&os.ModeSocket == 0 {
				return fmt.Errorf("%s exists and is not a socket (%s); refusing to replace it", path, fi.Mode().Type())
			}
			if err := os.Remove(path); err != nil { // a dead daemon's
				return fmt.Errorf("replace the stale socket %s: %w", path, err)
			}
		}
		err := unix.Renameat2(unix.AT_FDCWD, bound, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
			err = os.Rename(bound, path) // a file system without RENAME_NOREPLACE; we hold the lock
		}
		if err != nil {
			return fmt.Errorf("listen on %s: %w", path, err)
		}
		l.id, err = fileKey(path)
		return err
	})
	if err != nil {
		lis.Close()
		return nil, err
	}
	return l, nil
}

// bindUnix binds a unix socket at path, a name in folder dir. A path
// longer than a socket address holds is bound through /proc/self/fd
// instead (the folder's name is what is long).
func bindUnix(dir, path string) (*net.UnixListener, error) {
	if len(path) <= maxSocketPath {
		return net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	}
	d, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	short := fmt.Sprintf("/proc/self/fd/%d/%s", d.Fd(), filepath.Base(path))
	return net.ListenUnix("unix", &net.UnixAddr{Name: short, Net: "unix"})
}

// withDirLock runs f holding an exclusive flock of dir, waiting up to 10s
// for it.
func withDirLock(dir string, f func() error) error {
	d, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	defer d.Close() // releases the lock
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err = unix.Flock(int(d.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return f()
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			return fmt.Errorf("lock the socket folder %s: %w", dir, err)
		}
	}
}

// fileKey identifies the file at path (device and inode).
func fileKey(path string) ([2]uint64, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return [2]uint64{}, err
	}
	return [2]uint64{st.Dev, st.Ino}, nil
}

// unixListener is the daemon's listener. Close also removes the socket
// file, but only if it is still ours: a daemon started since (once this one
// stopped accepting) may have put its own there.
type unixListener struct {
	*net.UnixListener
	path string
	id   [2]uint64

	once sync.Once
	err  error
}

// Addr is the socket's path, not the name it was bound under.
func (l *unixListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *unixListener) Close() error {
	l.once.Do(func() {
		l.err = l.UnixListener.Close()
		rmErr := withDirLock(filepath.Dir(l.path), func() error {
			if id, err := fileKey(l.path); err != nil || id != l.id {
				return nil
			}
			return os.Remove(l.path)
		})
		if !errors.Is(rmErr, fs.ErrNotExist) { // the whole folder is gone
			l.err = errors.Join(l.err, rmErr)
		}
	})
	return l.err
}
