package test

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
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

// The default socket is private: in $XDG_RUNTIME_DIR (when set), mode
// 0600, its arena in /dev/shm named with the uid; a clean stop leaves
// neither behind.
func TestEdgeDefaultSocket(t *testing.T) {
	xdg := t.TempDir()
	socket := filepath.Join(xdg, "ckptd.sock")
	cmd := exec.Command(ckptdBin, "serve", "--storage", filepath.Join(t.TempDir(), "store"), "--staging-bytes", "64MiB")
	cmd.Env = append(os.Environ(), "XDG_RUNTIME_DIR="+xdg, "CKPTD_SOCKET=")
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	var fi os.FileInfo
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		var err error
		if fi, err = os.Lstat(socket); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no socket at %s", socket)
		}
	}
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
