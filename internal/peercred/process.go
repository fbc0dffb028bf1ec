package peercred

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"strconv"
)

// A connection's end is not its process's: a client stopped (SIGSTOP, a
// debugger, a frozen cgroup) loses its connection to keepalive but may
// resume and go on writing into the shared memory it had mapped. Exited
// tells the two apart by the peer's pid and the start time /proc records
// for it, so a pid reused by another process does not look alive.

// procStat returns the state letter and start time (clock ticks after
// boot) of process pid from /proc/<pid>/stat.
func procStat(pid int) (state byte, start uint64, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	// "pid (comm) state ppid ..." where comm may hold spaces and parens:
	// the fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("unparsable stat")
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 { // f[0] is field 3 (state); f[19] is field 22 (starttime)
		return 0, 0, errors.New("short stat")
	}
	start, err = strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil || len(f[0]) != 1 {
		return 0, 0, errors.New("unparsable stat")
	}
	return f[0][0], start, nil
}

// Exited reports whether the connection's peer process has ended; known
// is false where the daemon cannot tell (the peer is in another pid
// namespace, so its pid reads as 0, or /proc is not readable).
func (i *Info) Exited() (exited, known bool) {
	if i.PID <= 0 || i.start == 0 {
		return false, false
	}
	state, start, err := procStat(i.PID)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return true, true
	case err != nil:
		return false, false
	case start != i.start:
		return true, true // the pid now names another process
	case state == 'Z' || state == 'X':
		return true, true // exited, not yet reaped: it runs no code
	}
	return false, true
}
