package arena

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// ProcState is what /proc says of a process that holds something a new
// daemon needs (the arena lock, the socket).
type ProcState int

const (
	// ProcGone: no such pid in this pid namespace's /proc. The process has
	// exited, or it runs in another pid namespace (another container), or
	// the pid was never known.
	ProcGone ProcState = iota
	// ProcRunning: alive and not exiting (stopped and traced count too).
	ProcRunning
	// ProcExiting: a zombie, or dying (the kernel's PF_EXITING). A killed
	// process releases its locks and sockets only after it has unmapped its
	// memory, which takes seconds for a large mlocked arena.
	ProcExiting
)

func (s ProcState) String() string {
	switch s {
	case ProcRunning:
		return "running"
	case ProcExiting:
		return "exiting"
	default:
		return "not visible in /proc (exited, or in another pid namespace)"
	}
}

// pfExiting is the kernel's PF_EXITING task flag (include/linux/sched.h),
// set as soon as a task starts to exit.
const pfExiting = 0x4

// InspectProcess reads /proc/<pid>/stat and returns the process's state and
// its command name. What it cannot parse counts as running, so that a
// caller that only waits for exiting processes fails fast, as it would
// without this check.
func InspectProcess(pid int) (ProcState, string) {
	if pid <= 0 {
		return ProcGone, ""
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ProcGone, ""
	}
	return parseStat(string(b))
}

// parseStat parses "pid (comm) state ppid pgrp session tty tpgid flags ...";
// comm may itself hold spaces and parentheses, so it ends at the last ')'.
func parseStat(s string) (ProcState, string) {
	open, end := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || end < open {
		return ProcRunning, ""
	}
	comm := s[open+1 : end]
	f := strings.Fields(s[end+1:])
	if len(f) < 7 {
		return ProcRunning, comm
	}
	flags, _ := strconv.ParseUint(f[6], 10, 64)
	switch {
	case f[0] == "Z", f[0] == "X", f[0] == "x", flags&pfExiting != 0:
		return ProcExiting, comm
	default:
		return ProcRunning, comm
	}
}
