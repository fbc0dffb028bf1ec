package arena

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
)

func TestParseStat(t *testing.T) {
	for _, tc := range []struct {
		stat  string
		state ProcState
		comm  string
	}{
		{"4242 (ckptd) S 1 4242 4242 0 -1 4194560 120 0 0 0", ProcRunning, "ckptd"},
		{"4242 (ckptd) D 1 4242 4242 0 -1 4194564 120 0 0 0", ProcExiting, "ckptd"}, // PF_EXITING while unmapping
		{"4242 (ckptd) Z 1 4242 4242 0 -1 4227084 120 0 0 0", ProcExiting, "ckptd"},
		{"7 (a) (b) X 1 7 7 0 -1 0 0", ProcExiting, "a) (b"},
		{"7 (sleep) T 1 7 7 0 -1 4194304 0", ProcRunning, "sleep"}, // stopped is not exiting
		{"garbage", ProcRunning, ""},
		{"7 (short) S 1", ProcRunning, "short"},
	} {
		state, comm := parseStat(tc.stat)
		if state != tc.state || comm != tc.comm {
			t.Errorf("parseStat(%q) = %v %q, want %v %q", tc.stat, state, comm, tc.state, tc.comm)
		}
	}
}

func TestInspectProcess(t *testing.T) {
	if state, comm := InspectProcess(os.Getpid()); state != ProcRunning || comm == "" {
		t.Errorf("self: %v %q", state, comm)
	}
	if state, _ := InspectProcess(0); state != ProcGone {
		t.Errorf("pid 0: %v", state)
	}
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	waitFor(t, func() bool { s, _ := InspectProcess(pid); return s == ProcExiting }, "unreaped child to be a zombie")
	cmd.Wait()
	if state, _ := InspectProcess(pid); state != ProcGone {
		t.Errorf("reaped child: %v", state)
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	testtime.Until(t, 30*time.Second, what, cond)
}

const (
	holderDirEnv  = "CKPTD_ARENA_TEST_HOLDER_DIR"
	holderHoldEnv = "CKPTD_ARENA_TEST_HOLDER_HOLD" // "stay", or how long the lock outlives the helper
)

// TestHelperHolder is a lock holder run in a child process. With "stay" it
// keeps running; otherwise it hands its lock to a `sleep` child (same open
// file, so the same flock) and exits at once, as a killed daemon whose
// memory is still being unmapped holds its lock without running.
func TestHelperHolder(t *testing.T) {
	dir := os.Getenv(holderDirEnv)
	if dir == "" {
		t.Skip("helper process only")
	}
	a, err := Open(Options{Dir: dir, Size: mib})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	hold := os.Getenv(holderHoldEnv)
	if hold == "stay" {
		fmt.Println("ready 0")
		time.Sleep(time.Minute)
		os.Exit(1)
	}
	d, _ := time.ParseDuration(hold)
	sleep := exec.Command("sleep", strconv.FormatFloat(d.Seconds(), 'f', 3, 64))
	sleep.ExtraFiles = []*os.File{a.lockFile}
	if err := sleep.Start(); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("ready", sleep.Process.Pid)
	os.Exit(0)
}

// startHolder runs TestHelperHolder on dir and returns it (not waited for)
// once it holds the lock.
func startHolder(t *testing.T, dir, hold string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHolder$")
	cmd.Env = append(os.Environ(), holderDirEnv+"="+dir, holderHoldEnv+"="+hold)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, _ := bufio.NewReader(out).ReadString('\n')
	var sleeper int
	if _, err := fmt.Sscanf(line, "ready %d", &sleeper); err != nil {
		t.Fatalf("helper said %q", line)
	}
	if sleeper > 0 {
		t.Cleanup(func() { syscall.Kill(sleeper, syscall.SIGKILL) })
	}
	return cmd
}

// A restart right after a crash: the lock's holder is a zombie, or gone
// entirely, but the lock is held for a few seconds more. Open waits for it,
// says so, and then opens the arena.
func TestOpenWaitsForExitingHolder(t *testing.T) {
	for _, reaped := range []bool{false, true} {
		t.Run(fmt.Sprintf("reaped=%v", reaped), func(t *testing.T) {
			dir := t.TempDir() + "/arena"
			holder := startHolder(t, dir, "1.5s")
			pid := holder.Process.Pid
			if reaped {
				holder.Wait()
			} else {
				waitFor(t, func() bool { s, _ := InspectProcess(pid); return s == ProcExiting }, "helper to exit")
			}
			log, logs := testLogger()
			start := time.Now()
			a, err := Open(Options{Dir: dir, Size: mib, LockWait: 20 * time.Second, Logger: log})
			if err != nil {
				t.Fatalf("Open = %v\n%s", err, logs)
			}
			defer a.Close()
			if took := time.Since(start); took < 500*time.Millisecond {
				t.Errorf("Open took %v: it did not wait for the lock", took)
			}
			for _, want := range []string{"waiting for the lock", fmt.Sprintf("pid=%d", pid), "lock acquired"} {
				if !strings.Contains(logs.String(), want) {
					t.Errorf("log lacks %q:\n%s", want, logs)
				}
			}
		})
	}
}

// A holder that runs is another daemon: Open fails at once however long it
// may wait, naming the holder.
func TestOpenFailsFastForRunningHolder(t *testing.T) {
	dir := t.TempDir() + "/arena"
	holder := startHolder(t, dir, "stay")
	start := time.Now()
	_, err := Open(Options{Dir: dir, Size: mib, LockWait: 30 * time.Second})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", holder.Process.Pid)) ||
		!strings.Contains(err.Error(), "running") {
		t.Fatalf("Open = %v, want ErrInUse naming running pid %d", err, holder.Process.Pid)
	}
	if took := time.Since(start); took > testtime.Scale(5*time.Second) {
		t.Errorf("Open took %v to fail", took)
	}
}

// The wait is bounded.
func TestOpenLockWaitIsBounded(t *testing.T) {
	dir := t.TempDir() + "/arena"
	holder := startHolder(t, dir, "60s")
	pid := holder.Process.Pid
	holder.Wait()
	log, _ := testLogger()
	start := time.Now()
	_, err := Open(Options{Dir: dir, Size: mib, LockWait: 300 * time.Millisecond, Logger: log})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), fmt.Sprintf("still locked by pid %d", pid)) {
		t.Fatalf("Open = %v, want ErrInUse: still locked by pid %d", err, pid)
	}
	if took := time.Since(start); took < 300*time.Millisecond || took > testtime.Scale(10*time.Second) {
		t.Errorf("Open gave up after %v, want about 300ms", took)
	}
}
