package daemontest

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Command is exec.Command for a process a test starts: it gets SIGKILL
// when the test binary dies, so that no daemon or helper outlives a run
// killed by its timeout.
func Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// CLI runs a ckptd subcommand and returns its stdout, stderr and error.
func CLI(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	return CLIEnv(t, nil, args...)
}

// CLIEnv is CLI with env added to the command's environment.
func CLIEnv(t *testing.T, env []string, args ...string) (string, string, error) {
	t.Helper()
	cmd := Command(Bin(t), args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

// ExitCode is a command's exit status: 0 for no error, -1 for one that is
// not an exit.
func ExitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

// StatusJSON is `ckptd status --json` of the daemon on socket.
func StatusJSON(t *testing.T, socket string) *pb.DaemonStatus {
	t.Helper()
	out, stderr, err := CLI(t, "status", "--socket", socket, "--json")
	if err != nil {
		t.Fatalf("ckptd status --json: %v\n%s", err, stderr)
	}
	var st pb.DaemonStatus
	if err := protojson.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("not a DaemonStatus: %v\n%s", err, out)
	}
	return &st
}
