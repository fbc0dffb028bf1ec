package daemontest

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// DefaultArgs are what Start gives every daemon besides its socket,
// storage and arena: a small arena, the job "e2e", debug logs, and a short
// crash fence (the tests kill clients on purpose).
var DefaultArgs = []string{"--staging-bytes", "256MiB", "--job", "e2e", "--log-level", "debug", "--crash-fence", "300ms"}

// Daemon is a `ckptd serve` process, running or stopped.
type Daemon struct {
	T       *testing.T
	Socket  string
	Storage string
	Arena   string
	Args    []string // serve's arguments; Start runs them again
	Env     []string // added to the test's environment (S3 endpoint, credentials)
	Bin     string   // the binary to run; "" for Bin
	// DataLimit, when set, is the daemon's RLIMIT_DATA: the most private
	// writable memory (heap, stacks) it may map; past it allocations
	// fail and the Go runtime exits, which a test sees as a dead daemon.
	DataLimit uint64
	Cmd       *exec.Cmd

	mu      sync.Mutex
	log     bytes.Buffer
	exited  chan struct{}
	logDone chan struct{}
}

// New prepares a daemon on socket (dir/ckptd.sock of a new temporary dir
// when "") saving to storage (a new temporary folder when ""), with a new
// arena and args after those; it is stopped, and its arena removed, when
// the test ends. It does not start it.
func New(t *testing.T, socket, storage string, args ...string) *Daemon {
	t.Helper()
	dir := t.TempDir()
	if socket == "" {
		socket = filepath.Join(dir, "ckptd.sock")
	}
	if storage == "" {
		storage = filepath.Join(dir, "store")
	}
	d := &Daemon{T: t, Socket: socket, Storage: storage, Arena: ArenaDir()}
	d.Args = append([]string{"serve", "--socket", d.Socket, "--storage", storage, "--arena-dir", d.Arena}, args...)
	t.Cleanup(func() { d.Stop(); os.RemoveAll(d.Arena) })
	return d
}

// Start runs ckptd serve with DefaultArgs and extra, saving to storage (""
// for a new temporary folder), and waits until it answers.
func Start(t *testing.T, storage string, extra ...string) *Daemon {
	t.Helper()
	return StartEnv(t, storage, nil, extra...)
}

// StartEnv is Start with env added to the daemon's environment.
func StartEnv(t *testing.T, storage string, env []string, extra ...string) *Daemon {
	t.Helper()
	d := New(t, "", storage, append(append([]string{}, DefaultArgs...), extra...)...)
	d.Env = env
	d.Start()
	return d
}

// Start runs the daemon (again, after Stop or Kill9) with extra added to
// its arguments, and waits until it answers.
func (d *Daemon) Start(extra ...string) {
	d.T.Helper()
	bin := d.Bin
	if bin == "" {
		bin = Bin(d.T)
	}
	d.Cmd = Command(bin, append(append([]string{}, d.Args...), extra...)...)
	d.Cmd.Env = append(os.Environ(), d.Env...)
	pr, pw, err := os.Pipe()
	if err != nil {
		d.T.Fatal(err)
	}
	d.Cmd.Stdout, d.Cmd.Stderr = pw, pw
	if err := d.Cmd.Start(); err != nil {
		d.T.Fatal(err)
	}
	if d.DataLimit > 0 { // set at once: the daemon has not opened its socket yet
		lim := &unix.Rlimit{Cur: d.DataLimit, Max: d.DataLimit}
		if err := unix.Prlimit(d.Cmd.Process.Pid, unix.RLIMIT_DATA, lim, nil); err != nil {
			d.T.Fatal(err)
		}
	}
	pw.Close()
	d.exited, d.logDone = make(chan struct{}), make(chan struct{})
	go d.readLog(pr, d.logDone)
	go func(cmd *exec.Cmd, exited chan struct{}) { _ = cmd.Wait(); close(exited) }(d.Cmd, d.exited)
	d.WaitReady()
}

func (d *Daemon) readLog(pr *os.File, done chan struct{}) {
	defer close(done)
	defer pr.Close()
	sc := bufio.NewScanner(pr)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		d.mu.Lock()
		d.log.WriteString(sc.Text() + "\n")
		d.mu.Unlock()
	}
}

// WaitReady polls the socket until the daemon answers.
func (d *Daemon) WaitReady() {
	d.T.Helper()
	limit := 60 * time.Second
	ok := testtime.Within(limit, func() bool {
		select {
		case <-d.exited:
			return true
		default:
		}
		return d.answers()
	})
	select {
	case <-d.exited:
		<-d.logDone
		d.T.Fatalf("ckptd serve exited early:\n%s", d.Logs())
	default:
	}
	if !ok {
		d.T.Fatalf("ckptd serve not ready after %v:\n%s", testtime.Scale(limit), d.Logs())
	}
}

func (d *Daemon) answers() bool {
	c, err := ckptd.Dial(d.Socket)
	if err != nil {
		return false
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(2*time.Second))
	defer cancel()
	_, err = c.API().GetArena(ctx, &pb.GetArenaRequest{})
	return err == nil
}

// Exited is closed once the daemon's process has ended.
func (d *Daemon) Exited() <-chan struct{} { return d.exited }

// Logs is what the daemon wrote to stdout and stderr so far (all of it,
// once it has exited: Stop and Kill9 wait for the last line).
func (d *Daemon) Logs() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.log.String()
}

// Stop sends SIGTERM and waits for a clean exit and the last log line.
func (d *Daemon) Stop() {
	if d.Cmd == nil || d.Cmd.Process == nil {
		return
	}
	select {
	case <-d.exited:
	default:
		_ = d.Cmd.Process.Signal(syscall.SIGTERM)
		limit := testtime.Scale(2 * time.Minute)
		select {
		case <-d.exited:
		case <-time.After(limit):
			_ = d.Cmd.Process.Kill()
			<-d.exited
			d.T.Errorf("ckptd serve ignored SIGTERM for %v:\n%s", limit, d.Logs())
		}
	}
	<-d.logDone
}

// Kill9 kills the daemon the hard way, as a crash would.
func (d *Daemon) Kill9() {
	_ = d.Cmd.Process.Signal(syscall.SIGKILL)
	<-d.exited
	<-d.logDone
}

// Client dials the daemon; the connection closes when the test ends.
func (d *Daemon) Client() *ckptd.Client {
	d.T.Helper()
	c, err := ckptd.Dial(d.Socket)
	if err != nil {
		d.T.Fatal(err)
	}
	d.T.Cleanup(func() { c.Close() })
	return c
}
