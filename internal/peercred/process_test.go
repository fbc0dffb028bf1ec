package peercred

import (
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// A stopped process is alive; a killed one has exited, whether reaped or
// still a zombie; a pid whose process the daemon cannot see is unknown.
func TestExited(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	_, start, err := procStat(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	info := &Info{PID: cmd.Process.Pid, start: start}
	check := func(what string, wantExited, wantKnown bool) {
		t.Helper()
		if exited, known := info.Exited(); exited != wantExited || known != wantKnown {
			t.Fatalf("%s: Exited() = %v, %v; want %v, %v", what, exited, known, wantExited, wantKnown)
		}
	}
	check("running", false, true)
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	check("stopped", false, true)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	var si unix.Siginfo // wait for it to exit, leaving it a zombie
	if err := unix.Waitid(unix.P_PID, cmd.Process.Pid, &si, unix.WEXITED|unix.WNOWAIT, nil); err != nil {
		t.Fatal(err)
	}
	check("a zombie", true, true)
	_ = cmd.Wait()
	check("reaped", true, true)
	info.start++ // the pid's process is another one now
	check("another start time", true, true)
	if _, known := (&Info{PID: 0}).Exited(); known {
		t.Fatal("pid 0 (another namespace) is known")
	}
}
