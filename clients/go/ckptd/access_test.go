//go:build linux

package ckptd

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
)

// otherUID plays a trainer running as another user than the daemon.
const otherUID = 65534

// TestAccessHelper is the other user's side of TestPermissionDenied:
// it dials the socket named in its environment and prints the error.
func TestAccessHelper(t *testing.T) {
	socket := os.Getenv("CKPTD_ACCESS_SOCKET")
	if socket == "" {
		t.Skip("run by TestPermissionDenied as another user")
	}
	d := &dialer{socket: socket}
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(30*time.Second))
	defer cancel()
	c, err := d.dial(ctx, "")
	if err == nil {
		c.Close()
	}
	fmt.Printf("dial: %v\n", err)
}

// A trainer under another uid that may not use the socket is told whose
// socket (or folder) it is, with what mode, and that --socket-group lets
// it in: whether the socket refuses it, or the folder above it does (the
// daemon's own folder is 0700).
func TestPermissionDenied(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to play another user")
	}
	open := openTempDir(t)
	helper := copySelf(t, open)
	for _, tc := range []struct {
		name, dirMode string
		mode          os.FileMode
		want          []string
	}{
		{"socket", "0755", 0o755, []string{"the socket ", "belongs to uid 0, group 0, mode 600", "--socket-group"}},
		{"folder", "0700", 0o700, []string{"the socket's folder ", "belongs to uid 0, group 0, mode 700", "may not enter it", "--socket-group"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(open, tc.name)
			if err := os.Mkdir(dir, tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(dir, tc.mode); err != nil { // past the umask
				t.Fatal(err)
			}
			socket := filepath.Join(dir, "ckptd.sock")
			lis, err := net.Listen("unix", socket)
			if err != nil {
				t.Fatal(err)
			}
			defer lis.Close()
			if err := os.Chmod(socket, 0o600); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(helper, "-test.run=^TestAccessHelper$", "-test.v")
			cmd.Env = append(os.Environ(), "CKPTD_ACCESS_SOCKET="+socket)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: otherUID, Gid: otherUID}}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("helper as uid %d: %v\n%s", otherUID, err, out)
			}
			got := string(out)
			want := append([]string{"permission denied", "uid 65534", dir}, tc.want...)
			for _, w := range want {
				if !strings.Contains(got, w) {
					t.Errorf("the error lacks %q:\n%s", w, got)
				}
			}
		})
	}
}

// openTempDir is a temporary folder that every user may enter.
func openTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ckptd-access-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// copySelf copies the test binary into dir, where the other user can run
// it (go test builds it in a folder only we may enter).
func copySelf(t *testing.T, dir string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	dst := filepath.Join(dir, "helper")
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return dst
}
