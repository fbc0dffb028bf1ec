package test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

var ckptdBin string // the ckptd binary under test, built once by TestMain

var arenaSeq atomic.Int64 // makes each daemon's arena folder unique

// testAttempt is the attempt (run of the job) every client of these tests
// saves under unless a test names another, as a launcher setting
// CKPTD_ATTEMPT for all ranks would.
const testAttempt = "run1"

func TestMain(m *testing.M) {
	if act := os.Getenv("CKPTD_TEST_ACT"); act != "" { // a helper process of the trust and hostile tests
		runAct(act)
		os.Exit(0)
	}
	os.Setenv("CKPTD_ATTEMPT", testAttempt)
	dir, err := os.MkdirTemp("", "ckptd-e2e-bin")
	if err != nil {
		panic(err)
	}
	ckptdBin = filepath.Join(dir, "ckptd")
	build := exec.Command("go", "build", "-race", "-o", ckptdBin, "../cmd/ckptd")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building ckptd:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemon is a running `ckptd serve` process.
type daemon struct {
	t       *testing.T
	socket  string
	storage string
	arena   string
	args    []string
	env     []string // added to the test's environment (S3 endpoint, credentials)
	bin     string   // the binary to run; "" for ckptdBin
	// dataLimit, when set, is the daemon's RLIMIT_DATA: the most private
	// writable memory (heap, stacks) it may map; past it allocations
	// fail and the Go runtime exits, which a test sees as a dead daemon.
	dataLimit uint64
	cmd       *exec.Cmd
	mu        sync.Mutex
	log       bytes.Buffer
	exited    chan struct{}
}

// startDaemon runs ckptd serve with its own socket and arena; storage is
// the folder to save to ("" for a new temporary one). The daemon is stopped
// with SIGTERM at the end of the test.
func startDaemon(t *testing.T, storage string, extra ...string) *daemon {
	t.Helper()
	return startDaemonEnv(t, storage, nil, extra...)
}

// startDaemonEnv is startDaemon with env added to the daemon's environment.
func startDaemonEnv(t *testing.T, storage string, env []string, extra ...string) *daemon {
	t.Helper()
	dir := t.TempDir()
	if storage == "" {
		storage = filepath.Join(dir, "store")
	}
	d := &daemon{
		t: t, socket: filepath.Join(dir, "ckptd.sock"), storage: storage, env: env,
		arena: filepath.Join("/dev/shm", fmt.Sprintf("ckptd-test-%d-%d", os.Getpid(), arenaSeq.Add(1))),
	}
	d.args = append([]string{"serve", "--socket", d.socket, "--storage", storage, "--arena-dir", d.arena,
		"--staging-bytes", "256MiB", "--job", "e2e", "--log-level", "debug", "--crash-fence", "300ms"}, extra...)
	t.Cleanup(func() { d.stop(); os.RemoveAll(d.arena) })
	d.start()
	return d
}

func (d *daemon) start(extra ...string) {
	d.t.Helper()
	bin := d.bin
	if bin == "" {
		bin = ckptdBin
	}
	d.cmd = exec.Command(bin, append(append([]string{}, d.args...), extra...)...)
	d.cmd.Env = append(os.Environ(), d.env...)
	pr, pw, _ := os.Pipe()
	d.cmd.Stdout, d.cmd.Stderr = pw, pw
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	if d.dataLimit > 0 { // set at once: the daemon has not opened its socket yet
		lim := &unix.Rlimit{Cur: d.dataLimit, Max: d.dataLimit}
		if err := unix.Prlimit(d.cmd.Process.Pid, unix.RLIMIT_DATA, lim, nil); err != nil {
			d.t.Fatal(err)
		}
	}
	pw.Close()
	d.exited = make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			d.mu.Lock()
			d.log.WriteString(sc.Text() + "\n")
			d.mu.Unlock()
		}
	}()
	go func() { _ = d.cmd.Wait(); close(d.exited) }()
	d.waitReady()
}

// waitReady polls the socket until the daemon answers.
func (d *daemon) waitReady() {
	d.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-d.exited:
			d.t.Fatalf("ckptd serve exited early:\n%s", d.logs())
		default:
		}
		c, err := ckptd.Dial(d.socket)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_, err = c.API().GetArena(ctx, &pb.GetArenaRequest{})
			cancel()
			c.Close()
			if err == nil {
				return
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.t.Fatalf("ckptd serve not ready after 30s:\n%s", d.logs())
}

func (d *daemon) logs() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.log.String()
}

// stop sends SIGTERM and waits for a clean exit.
func (d *daemon) stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	select {
	case <-d.exited:
		return
	default:
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(60 * time.Second):
		_ = d.cmd.Process.Kill()
		d.t.Errorf("ckptd serve ignored SIGTERM for 60s:\n%s", d.logs())
	}
}

// kill9 kills the daemon the hard way, as a crash would.
func (d *daemon) kill9() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
}

func (d *daemon) client() *ckptd.Client {
	d.t.Helper()
	c, err := ckptd.Dial(d.socket)
	if err != nil {
		d.t.Fatal(err)
	}
	d.t.Cleanup(func() { c.Close() })
	return c
}

// ckptdCLI runs a ckptd subcommand and returns its stdout, stderr and error.
func ckptdCLI(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	return ckptdCLIEnv(t, nil, args...)
}

// ckptdCLIEnv is ckptdCLI with env added to the command's environment.
func ckptdCLIEnv(t *testing.T, env []string, args ...string) (string, string, error) {
	t.Helper()
	cmd := exec.Command(ckptdBin, args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}
