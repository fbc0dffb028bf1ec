package daemon

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// maxNice is the nicest a Linux thread can be.
const maxNice = 19

// lowerPriority makes every thread of the process n nice levels nicer
// than the calling thread is now (at most 19), and returns the nice value
// they run at. A sidecar must never slow the job beside it: when both
// want a core, the trainer (whose wake-up after a training step is the
// one that counts) is scheduled first, and the daemon's reads, copies and
// drains fill the time it leaves. Linux applies nice per thread, and a
// new thread inherits its creator's, so every thread the Go runtime has
// started is set, over again until a pass finds none left behind (one
// started meanwhile by a thread not yet set).
func lowerPriority(n int) (int, error) {
	self, err := niceOf(0)
	if err != nil || n == 0 {
		return self, err
	}
	target := min(self+n, maxNice)
	for range 5 {
		behind, err := setThreads(target)
		if err != nil || !behind {
			return target, err
		}
	}
	return target, nil
}

// setThreads sets every thread of the process less nice than target to
// target, and reports whether it found one.
func setThreads(target int) (bool, error) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return false, err
	}
	behind := false
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		nice, err := niceOf(tid)
		if err != nil || nice >= target {
			continue // gone, or nicer already
		}
		behind = true
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, target); err != nil && !errors.Is(err, unix.ESRCH) {
			return false, fmt.Errorf("nice thread %d to %d: %w", tid, target, err)
		}
	}
	return behind, nil
}

// niceOf is a thread's nice value (tid 0: the calling thread's). The
// system call answers 20 - nice, so that it is never negative.
func niceOf(tid int) (int, error) {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return 0, err
	}
	return 20 - p, nil
}
