package lifecycle

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/test/daemontest"
)

// shmEntries lists the /dev/shm entries that a daemon on socket could
// have made: its default arena names (any uid, any suffix) and the names
// given in extra. Other tests and processes use /dev/shm meanwhile.
func shmEntries(t *testing.T, socket string, extra ...string) []string {
	t.Helper()
	sum := sha256.Sum256([]byte(socket))
	hash := hex.EncodeToString(sum[:6])
	ents, err := os.ReadDir("/dev/shm")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if strings.Contains(e.Name(), hash) || slices.Contains(extra, e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// startEdgeDaemon is daemontest.Start without its short crash fence.
func startEdgeDaemon(t *testing.T, extra ...string) *daemontest.Daemon {
	t.Helper()
	d := daemontest.New(t, "", "", append([]string{"--staging-bytes", "256MiB", "--job", "e2e", "--log-level", "debug"}, extra...)...)
	d.Start()
	return d
}

// runServeCLI runs a `ckptd serve` that is expected to fail, and returns
// its exit code, stderr and how long it took.
func runServeCLI(t *testing.T, args ...string) (int, string, time.Duration) {
	t.Helper()
	start := time.Now()
	_, stderr, err := daemontest.CLI(t, append([]string{"serve", "--staging-bytes", "64MiB", "--log-level", "debug"}, args...)...)
	took := time.Since(start)
	if err == nil {
		t.Fatalf("serve %q succeeded", args)
	}
	code := -1
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	}
	return code, stderr, took
}

// A `ckptd serve` that cannot start leaves /dev/shm and its socket folder
// as they were, whichever check fails, and fails fast when another daemon
// runs.
func TestEdgeFailedStartLeavesNothing(t *testing.T) {
	d := startEdgeDaemon(t)
	token := filepath.Base(daemontest.ArenaDir()) // reaped if this run dies
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o600)
	cfg := filepath.Join(t.TempDir(), "ckptd.yaml")
	os.WriteFile(cfg, []byte("staging_bytes: 1GiB\n"), 0o600)

	for _, tc := range []struct {
		name   string
		socket string // "" for a fresh one
		args   []string
		code   int
		want   []string
	}{
		// The reported bug: the arena was allocated before the socket was checked.
		{"busy socket, other arena", d.Socket, []string{"--arena-dir", "/dev/shm/" + token},
			1, []string{"already serving on " + d.Socket, fmt.Sprintf("pid %d", d.Cmd.Process.Pid)}},
		{"busy socket, default arena", d.Socket, nil, 1, []string{"already serving"}},
		{"arena in use", "", []string{"--arena-dir", d.Arena},
			1, []string{"arena in use", fmt.Sprintf("locked by pid %d", d.Cmd.Process.Pid), "running"}},
		{"arena too large", "", []string{"--staging-bytes", "1TiB"}, 1, []string{"allocate"}},
		{"storage unusable", "", []string{"--storage", filepath.Join(file, "store")}, 1, []string{"storage"}},
		{"bad flag", "", []string{"--chunk-size", "3"}, 2, []string{"--chunk-size"}},
		{"unknown config key", "", []string{"--config", cfg}, 2, []string{`"staging_bytes"`, `"staging-bytes"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			socket := tc.socket
			if socket == "" {
				socket = filepath.Join(t.TempDir(), "ckptd.sock")
			}
			sockDir := filepath.Dir(socket)
			shmBefore, dirBefore := shmEntries(t, socket, token), dirEntries(t, sockDir)
			args := append([]string{"--socket", socket, "--storage", filepath.Join(t.TempDir(), "store")}, tc.args...)
			code, stderr, took := runServeCLI(t, args...)
			if code != tc.code {
				t.Errorf("exit code %d, want %d", code, tc.code)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr lacks %q:\n%s", w, stderr)
				}
			}
			if took > 10*time.Second {
				t.Errorf("took %v to fail (a running daemon must fail the start at once)", took)
			}
			if got := shmEntries(t, socket, token); !slices.Equal(got, shmBefore) {
				t.Errorf("/dev/shm: %q before, %q after", shmBefore, got)
			}
			if got := dirEntries(t, sockDir); !slices.Equal(got, dirBefore) {
				t.Errorf("socket folder: %q before, %q after", dirBefore, got)
			}
		})
	}
	c := d.Client()
	if _, err := c.Save(daemontest.Ctx(t), daemontest.Shard(1, 0, 1)); err != nil {
		t.Fatalf("the running daemon was disturbed: %v", err)
	}
}

// holderSrc is a process that takes an arena's lock (writing its pid, as a
// daemon does) and listens on a socket, hands both to `sleep` and exits:
// what a daemon killed a moment ago looks like while the kernel unmaps its
// arena, before it closes its files.
const holderSrc = `package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
)

func main() {
	lock, sock, hold := os.Args[1], os.Args[2], os.Args[3]
	f, err := os.OpenFile(lock, os.O_RDWR|os.O_CREATE, 0o600)
	if err == nil {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err == nil {
		f.Truncate(0)
		_, err = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	os.Remove(sock)
	var l *net.UnixListener
	if err == nil {
		l, err = net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	}
	var lf *os.File
	if err == nil {
		l.SetUnlinkOnClose(false)
		lf, err = l.File()
	}
	if err == nil {
		cmd := exec.Command("sleep", hold)
		cmd.ExtraFiles = []*os.File{f, lf}
		if err = cmd.Start(); err == nil {
			fmt.Println(cmd.Process.Pid)
			return
		}
	}
	fmt.Println("error:", err)
	os.Exit(1)
}
`

// startHolder builds holderSrc and runs it on an arena's lock and a
// socket; it returns the holder (exited, not reaped: a zombie) once it has
// handed both to a `sleep` of hold seconds.
func startHolder(t *testing.T, lock, socket, hold string) *exec.Cmd {
	t.Helper()
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "main.go"), []byte(holderSrc), 0o600)
	os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module holder\n\ngo 1.26\n"), 0o600)
	holderBin := filepath.Join(dir, "holder")
	build := daemontest.Command("go", "build", "-o", holderBin, ".")
	build.Dir = dir
	build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the holder: %v\n%s", err, out)
	}
	cmd := daemontest.Command(holderBin, lock, socket, hold)
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	sleeper, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("holder said %q", line)
	}
	t.Cleanup(func() { syscall.Kill(sleeper, syscall.SIGKILL); cmd.Wait() })
	return cmd
}

// A restart right after a crash: the killed daemon still holds its socket
// and its arena's lock for a few seconds while the kernel unmaps its
// memory. The new daemon waits for them, says so, then recovers the
// journal and commits the save.
func TestEdgeRestartWhileExiting(t *testing.T) {
	d := startEdgeDaemon(t, "--debug-drain-delay", "1h")
	c := d.Client()
	want := daemontest.Shard(5, 0, 1)
	if _, err := c.Save(daemontest.Ctx(t), want); err != nil {
		t.Fatal(err)
	}
	d.Kill9()

	holder := startHolder(t, filepath.Join(d.Arena, "lock"), d.Socket, "3")
	start := time.Now()
	d.Start("--debug-drain-delay", "0s") // returns once it answers
	if took := time.Since(start); took < 2*time.Second {
		t.Errorf("came up after %v, while the old daemon held the lock for 3s", took)
	}
	for _, w := range []string{"waiting for the previous daemon", fmt.Sprintf("pid=%d", holder.Process.Pid),
		"socket released", "recovered staged save"} {
		if !strings.Contains(d.Logs(), w) {
			t.Errorf("log lacks %q:\n%s", w, d.Logs())
		}
	}
	c2 := d.Client()
	if err := daemontest.WaitStep(t, c2, 5, 0); err != nil {
		t.Fatal(err)
	}
	got, err := c2.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 5, Rank: 0})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, want)
}

// The default socket is private: in $XDG_RUNTIME_DIR (when set), mode
// 0600, its arena in /dev/shm named with the uid; a clean stop leaves
// neither behind.
func TestEdgeDefaultSocket(t *testing.T) {
	xdg := t.TempDir()
	socket := filepath.Join(xdg, "ckptd.sock")
	cmd := daemontest.Command(daemontest.Bin(t), "serve", "--storage", filepath.Join(t.TempDir(), "store"), "--staging-bytes", "64MiB")
	cmd.Env = append(os.Environ(), "XDG_RUNTIME_DIR="+xdg, "CKPTD_SOCKET=")
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var fi os.FileInfo
	testtime.Until(t, time.Minute, "a socket at "+socket, func() bool {
		var err error
		fi, err = os.Lstat(socket)
		return err == nil
	})
	if fi.Mode() != os.ModeSocket|0o600 {
		t.Errorf("socket mode %v, want 0600", fi.Mode())
	}
	arenas := shmEntries(t, socket)
	if len(arenas) != 1 || !strings.HasPrefix(arenas[0], fmt.Sprintf("ckptd-%d-", os.Getuid())) {
		t.Errorf("arena folders %q, want one named ckptd-<uid>-<hash>", arenas)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v:\n%s", err, logs.String())
	}
	if got := shmEntries(t, socket); len(got) != 0 {
		t.Errorf("arena left: %q", got)
	}
	if got := dirEntries(t, xdg); len(got) != 0 {
		t.Errorf("socket folder left with %q", got)
	}
}
