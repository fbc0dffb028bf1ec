package arena

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// lockPoll is how often a waiting Open retries the lock, and lockLogEvery
// how often it says that it is still waiting.
const (
	lockPoll     = 100 * time.Millisecond
	lockLogEvery = 5 * time.Second
)

// lockArena makes the directory ours (prepareDir) and takes its lock,
// recording in made what it created. A lock held by a process that is
// running fails at once with ErrInUse. A lock whose holder is exiting or
// cannot be seen (a daemon killed a moment ago still unmapping its arena;
// one in another pid namespace; one that has not written its pid yet) is
// waited for, for up to opts.LockWait, with a log line every few seconds.
func lockArena(opts Options, made *created, log *slog.Logger) (*os.File, error) {
	record := []byte(strconv.Itoa(os.Getpid()) + "\n" + opts.Owner + "\n")
	path := filepath.Join(opts.Dir, lockFile)
	start := time.Now()
	var logged time.Time
	for {
		c, err := prepareDir(opts.Dir, opts.access())
		if err != nil {
			return nil, err
		}
		made.dir = made.dir || c
		f, c, holder, err := tryLock(path, record)
		if err != nil {
			return nil, err
		}
		if f != nil {
			made.lock = c
			if !logged.IsZero() {
				log.Info("arena: lock acquired", "lock", path, "waited", time.Since(start).Round(time.Millisecond))
			}
			return f, nil
		}
		waited := time.Since(start)
		if holder < 0 && waited < max(opts.LockWait, time.Second) {
			continue // the lock file was replaced under us: lock the new one
		}
		state, comm := InspectProcess(holder)
		if (holder > 0 && state == ProcRunning) || waited >= opts.LockWait {
			return nil, inUseError(path, holder, state, comm, waited)
		}
		if time.Since(logged) >= lockLogEvery {
			logged = time.Now()
			log.Warn("arena: waiting for the lock of the arena's previous owner, which is not running "+
				"(a daemon killed a moment ago releases it once it has unmapped its memory)",
				"lock", path, "pid", holder, "command", comm, "state", state.String(),
				"waited", waited.Round(time.Millisecond), "limit", opts.LockWait)
		}
		time.Sleep(lockPoll)
	}
}

// tryLock takes the exclusive flock that makes one daemon the owner of an
// arena directory, without blocking. flock, unlike a pid file alone, is
// released by the kernel when the holder dies, so a crashed daemon never
// blocks its successor for good. The pid written inside is for the error
// message and for telling a running holder from an exiting one.
//
// It writes record into the lock it takes: the pid, then what Owner names.
// It returns the locked file (and whether it created it), or nil and the
// holder's pid: 0 when the holder has not written it yet, -1 when the lock
// file was deleted or replaced while we locked it (a daemon removing its
// arena) and the caller should simply try again.
func tryLock(path string, record []byte) (f *os.File, created bool, holder int, err error) {
	f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, privateMode)
	created = err == nil
	if errors.Is(err, fs.ErrExist) {
		f, err = os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	}
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, -1, nil
	}
	if err != nil {
		return nil, false, 0, fmt.Errorf("arena: open lock file: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, false, readPID(f), nil
		}
		return nil, false, 0, fmt.Errorf("arena: lock %s: %w", path, err)
	}
	if !samePath(f, path) {
		f.Close()
		return nil, false, -1, nil
	}
	err = f.Truncate(0)
	if err == nil {
		_, err = f.WriteAt(record, 0)
	}
	if err != nil {
		f.Close()
		return nil, false, 0, fmt.Errorf("arena: write pid to %s: %w", path, err)
	}
	return f, created, 0, nil
}

// samePath reports whether the open file f is still the file at path: a
// lock taken on a file that its previous holder has since unlinked
// protects nothing.
func samePath(f *os.File, path string) bool {
	var a, b unix.Stat_t
	return unix.Fstat(int(f.Fd()), &a) == nil && unix.Lstat(path, &b) == nil && a.Dev == b.Dev && a.Ino == b.Ino
}

// readPID returns the pid in a lock file, or 0 if there is none yet.
func readPID(f *os.File) int {
	pid, _ := readLock(f)
	return pid
}

// readLock returns what a lock file records: the holder's pid (0 if none
// yet) and its owner, the socket of the daemon that took it ("" for a
// daemon that did not record one).
func readLock(f *os.File) (int, string) {
	buf := make([]byte, 4096+32)
	n, _ := f.ReadAt(buf, 0)
	first, rest, _ := bytes.Cut(buf[:n], []byte("\n"))
	owner, _, _ := bytes.Cut(rest, []byte("\n"))
	pid, err := strconv.Atoi(string(bytes.TrimSpace(first)))
	if err != nil || pid <= 0 {
		pid = 0
	}
	return pid, string(owner)
}

func inUseError(path string, pid int, state ProcState, comm string, waited time.Duration) error {
	const hint = "(another ckptd serve on this arena directory?)"
	switch {
	case pid <= 0:
		// The holder may not have written its pid yet; say so rather than guess.
		return fmt.Errorf("%w: %s is locked by another process %s", ErrInUse, path, hint)
	case state == ProcRunning:
		return fmt.Errorf("%w: %s is locked by pid %d (%s, running) %s", ErrInUse, path, pid, comm, hint)
	default:
		return fmt.Errorf("%w: %s is still locked by pid %d (%s) after waiting %s for it to exit",
			ErrInUse, path, pid, state, waited.Round(time.Millisecond))
	}
}
