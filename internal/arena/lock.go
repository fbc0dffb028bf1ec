package arena

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// acquireLock takes the exclusive flock that makes one daemon the owner of
// an arena directory. flock, unlike a pid file alone, is released by the
// kernel when the holder dies, so a crashed daemon never blocks its
// successor. The pid inside is only for the error message.
func acquireLock(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, privateMode)
	if err != nil {
		return nil, fmt.Errorf("arena: open lock file: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, inUseError(path, f)
		}
		return nil, fmt.Errorf("arena: lock %s: %w", path, err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()) + "\n")
	err = f.Truncate(0)
	if err == nil {
		_, err = f.WriteAt(pid, 0)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("arena: write pid to %s: %w", path, err)
	}
	return f, nil
}

func inUseError(path string, f *os.File) error {
	buf := make([]byte, 32)
	n, _ := f.ReadAt(buf, 0)
	// The holder may not have written its pid yet; say so rather than guess.
	pid, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n])))
	if err != nil || pid <= 0 {
		return fmt.Errorf("%w: %s is locked by another process (another ckptd serve on this arena directory?)",
			ErrInUse, path)
	}
	return fmt.Errorf("%w: %s is locked by pid %d (another ckptd serve on this arena directory?)",
		ErrInUse, path, pid)
}
