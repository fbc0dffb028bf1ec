package arena

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// lockArena makes the directory ours (prepareDir) and takes its lock,
// recording in made what it created.
func lockArena(opts Options, made *created) (*os.File, error) {
	path := filepath.Join(opts.Dir, lockFile)
	for start := time.Now(); ; {
		c, err := prepareDir(opts.Dir, opts.access())
		if err != nil {
			return nil, err
		}
		made.dir = made.dir || c
		f, c, holder, err := tryLock(path)
		if err != nil {
			return nil, err
		}
		if f != nil {
			made.lock = c
			return f, nil
		}
		if holder < 0 && time.Since(start) < time.Second {
			continue // the lock file was replaced under us: lock the new one
		}
		return nil, inUseError(path, holder)
	}
}

// tryLock takes the exclusive flock that makes one daemon the owner of an
// arena directory, without blocking. flock, unlike a pid file alone, is
// released by the kernel when the holder dies, so a crashed daemon never
// blocks its successor for good. The pid written inside is for the error
// message.
//
// It returns the locked file (and whether it created it), or nil and the
// holder's pid: 0 when the holder has not written it yet, -1 when the lock
// file was deleted or replaced while we locked it (a daemon removing its
// arena) and the caller should simply try again.
func tryLock(path string) (f *os.File, created bool, holder int, err error) {
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
	pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
	err = f.Truncate(0)
	if err == nil {
		_, err = f.WriteAt(pid, 0)
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
	buf := make([]byte, 32)
	n, _ := f.ReadAt(buf, 0)
	pid, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n])))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

func inUseError(path string, pid int) error {
	if pid <= 0 {
		// The holder may not have written its pid yet; say so rather than guess.
		return fmt.Errorf("%w: %s is locked by another process (another ckptd serve on this arena directory?)",
			ErrInUse, path)
	}
	return fmt.Errorf("%w: %s is locked by pid %d (another ckptd serve on this arena directory?)",
		ErrInUse, path, pid)
}
