// Package testreap removes what a test binary leaves in /dev/shm when it
// dies before its cleanups run (its timeout's panic, a kill -9): the
// arenas of the daemons it started, and those it made in process. Such a
// binary names them with Prefix; Run starts a reaper, a shell that
// outlives the binary by design, waits for the binary's end (its standard
// input closes then, however the binary went) and removes what bears the
// prefix. Processes a test starts are the test's to end (Pdeathsig).
package testreap

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// Prefix begins the name of every /dev/shm entry of this test process.
var Prefix = fmt.Sprintf("/dev/shm/ckptd-test-%d-", os.Getpid())

// Run runs m's tests with a reaper watching this process and returns
// their exit code, having first removed what test processes now gone
// left, should a reaper ever have died with its binary.
func Run(m *testing.M) int {
	sweepDead()
	stop, err := start()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreap:", err)
		return 1
	}
	defer stop()
	return m.Run()
}

// start runs the reaper in a process group of its own, so that a Ctrl-C
// meant for the tests does not end it first.
func start() (stop func(), err error) {
	cmd := exec.Command("/bin/sh", "-c", `cat >/dev/null; rm -rf "$0"*`, Prefix)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	w, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the reaper: %w", err)
	}
	return func() { w.Close(); _ = cmd.Wait() }, nil
}

func sweepDead() {
	ents, _ := os.ReadDir("/dev/shm")
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), "ckptd-test-")
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			os.RemoveAll(filepath.Join("/dev/shm", e.Name()))
		}
	}
}
