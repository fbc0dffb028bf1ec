package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/testtime"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func TestDefaultSocket(t *testing.T) {
	uid := os.Getuid()
	for _, tc := range []struct{ env, xdg, want string }{
		{"/run/x.sock", "/run/user/7", "/run/x.sock"},
		{"", "/run/user/7", "/run/user/7/ckptd.sock"},
		{"", "", fmt.Sprintf("/tmp/ckptd-%d/ckptd.sock", uid)},
	} {
		t.Setenv("CKPTD_SOCKET", tc.env)
		t.Setenv("XDG_RUNTIME_DIR", tc.xdg)
		if got := DefaultSocket(); got != tc.want {
			t.Errorf("CKPTD_SOCKET=%q XDG_RUNTIME_DIR=%q: DefaultSocket() = %q, want %q", tc.env, tc.xdg, got, tc.want)
		}
	}
}

// useTmpRoot points the default socket's /tmp at a fresh folder, with
// neither CKPTD_SOCKET nor XDG_RUNTIME_DIR set, and returns the default
// socket folder (not created yet).
func useTmpRoot(t *testing.T) string {
	t.Helper()
	old := tmpRoot
	tmpRoot = t.TempDir()
	t.Cleanup(func() { tmpRoot = old })
	t.Setenv("CKPTD_SOCKET", "")
	t.Setenv("XDG_RUNTIME_DIR", "")
	return filepath.Join(tmpRoot, fmt.Sprintf("ckptd-%d", os.Getuid()))
}

func modeOf(t *testing.T, path string) (os.FileMode, int) {
	t.Helper()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode(), int(fi.Sys().(*syscall.Stat_t).Gid)
}

// The default socket folder is made private, and one that another user
// could have prepared is refused with the owner and the fix.
func TestDefaultSocketFolder(t *testing.T) {
	dir := useTmpRoot(t)
	sp, err := prepareSocket("", -1, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if sp.path != filepath.Join(dir, "ckptd.sock") || sp.madeDir != dir || !sp.private {
		t.Fatalf("socket place %+v", sp)
	}
	if m, _ := modeOf(t, dir); m != os.ModeDir|0o700 {
		t.Errorf("mode %v, want 0700", m)
	}
	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 4242 // any group will do for root
	}
	if _, err := prepareSocket("", gid, quiet); err != nil {
		t.Fatal(err)
	}
	if m, g := modeOf(t, dir); m != os.ModeDir|0o750 || g != gid {
		t.Errorf("with --socket-group: mode %v group %d, want 0750 and %d", m, g, gid)
	}

	refuse := func(what string, want ...string) {
		t.Helper()
		_, err := prepareSocket("", -1, quiet)
		for _, w := range append(want, "--socket") {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v, want an error naming %q", what, err, w)
			}
		}
	}
	os.Chmod(dir, 0o777)
	refuse("writable by others", "writable by group or others", "chmod go-w")
	os.Chmod(dir, 0o700)
	os.Remove(dir)
	target := t.TempDir()
	os.Symlink(target, dir)
	refuse("symlink", "symbolic link", target)
	os.Remove(dir)
	if os.Geteuid() == 0 {
		os.Mkdir(dir, 0o700)
		os.Chown(dir, 12345, 12345)
		refuse("another user's", "owned by uid 12345")
	}
}

// XDG_RUNTIME_DIR is the session's: checked, never created.
func TestXDGSocketFolder(t *testing.T) {
	useTmpRoot(t)
	xdg := filepath.Join(t.TempDir(), "run")
	t.Setenv("XDG_RUNTIME_DIR", xdg)
	if _, err := prepareSocket("", -1, quiet); err == nil || !strings.Contains(err.Error(), "XDG_RUNTIME_DIR") {
		t.Fatalf("missing XDG_RUNTIME_DIR: %v", err)
	}
	if _, err := os.Stat(xdg); !os.IsNotExist(err) {
		t.Fatal("XDG_RUNTIME_DIR created")
	}
	os.Mkdir(xdg, 0o700)
	sp, err := prepareSocket("", -1, quiet)
	if err != nil || sp.path != filepath.Join(xdg, "ckptd.sock") || sp.madeDir != "" {
		t.Fatalf("%+v %v", sp, err)
	}
	long := "/" + strings.Repeat("x", maxSocketPath)
	if _, err := prepareSocket(long, -1, quiet); !errors.As(err, new(UsageError)) || !strings.Contains(err.Error(), "at most 107") {
		t.Fatalf("a socket path too long: %v", err)
	}
}

// The socket is never more open than 0600 (0660 with a group), whatever
// the umask, and a live daemon's is never taken; a stale one is.
func TestListenUnix(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := t.TempDir()
	path := filepath.Join(dir, "ckptd.sock")
	lis, err := listenUnix(path, -1)
	if err != nil {
		t.Fatal(err)
	}
	if m, _ := modeOf(t, path); m != os.ModeSocket|0o600 {
		t.Errorf("mode %v, want 0600", m)
	}
	if _, err := listenUnix(path, -1); err == nil || !strings.Contains(err.Error(), "already serving") {
		t.Fatalf("second listen: %v", err)
	}
	if live, pid, _ := probeSocket(path); !live || pid != os.Getpid() {
		t.Fatalf("the first listener lost its socket: live %v pid %d", live, pid)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("folder holds %v, want the socket alone", ents)
	}
	lis.(*unixListener).UnixListener.Close() // a crash: the file stays, nobody listens
	lis2, err := listenUnix(path, -1)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	lis.Close() // the old listener's Close leaves the new socket alone
	if live, _, _ := probeSocket(path); !live {
		t.Fatal("an old listener's Close removed its successor's socket")
	}
	lis2.Close()
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("Close left the socket: %v", err)
	}

	gid := os.Getgid()
	if os.Geteuid() == 0 {
		gid = 4242
	}
	lis, err = listenUnix(path, gid)
	if err != nil {
		t.Fatal(err)
	}
	if m, g := modeOf(t, path); m != os.ModeSocket|0o660 || g != gid {
		t.Errorf("with a group: mode %v group %d, want 0660 and %d", m, g, gid)
	}
	lis.Close()

	os.WriteFile(path, []byte("not a socket"), 0o600)
	if _, err := listenUnix(path, -1); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("listen over a regular file: %v", err)
	}
}

// A socket path near the limit still binds (the temporary name is longer).
func TestListenUnixLongPath(t *testing.T) {
	dir := t.TempDir()
	dir = filepath.Join(dir, strings.Repeat("d", maxSocketPath-len(dir)-len("/ckptd.sock")-1))
	os.Mkdir(dir, 0o700)
	path := filepath.Join(dir, "ckptd.sock")
	if len(path) != maxSocketPath {
		t.Fatalf("path of %d bytes", len(path))
	}
	lis, err := listenUnix(path, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	if live, _, _ := probeSocket(path); !live {
		t.Fatal("not listening at the long path")
	}
}

// Two daemons starting at once on one socket: exactly one gets it.
func TestListenUnixRace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ckptd.sock")
	for range 10 {
		var wg sync.WaitGroup
		lis := make([]net.Listener, 4)
		for i := range lis {
			wg.Go(func() { lis[i], _ = listenUnix(path, -1) })
		}
		wg.Wait()
		won := 0
		for _, l := range lis {
			if l != nil {
				won++
				defer l.Close()
			}
		}
		if won != 1 {
			t.Fatalf("%d listeners got the socket", won)
		}
		for _, l := range lis {
			if l != nil {
				l.Close()
			}
		}
	}
}

// useShm points the default arena folder at a fresh folder.
func useShm(t *testing.T) string {
	t.Helper()
	old := shmDir
	shmDir = t.TempDir()
	t.Cleanup(func() { shmDir = old })
	return shmDir
}

// A default arena name taken by someone else gives way to a fresh random
// one, recorded next to the socket, where a restart finds it again.
func TestDefaultArenaTaken(t *testing.T) {
	shm := useShm(t)
	sockDir := t.TempDir()
	sp := &socketPlace{path: filepath.Join(sockDir, "ckptd.sock"), dir: sockDir, private: true}
	o := &Options{}
	opts := arena.Options{Size: 1 << 20, Logger: quiet}

	a, place, err := openArena(o, sp, opts, quiet)
	if err != nil {
		t.Fatal(err)
	}
	preferred := place.dir
	if want := fmt.Sprintf("ckptd-%d-", os.Getuid()); !strings.HasPrefix(filepath.Base(preferred), want) || place.write {
		t.Fatalf("default arena %+v, want %s<hash> and no pointer", place, want)
	}
	a.Remove()

	// Someone plants a symlink (as good as another user's folder) there.
	os.Symlink(t.TempDir(), preferred)
	a, place, err = openArena(o, sp, opts, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(place.dir, preferred+"-") || !place.write {
		t.Fatalf("arena %+v, want a fresh name after %s", place, preferred)
	}
	if err := place.writePointer(); err != nil {
		t.Fatal(err)
	}
	a.Journal().Put("staged", []byte("{}"))
	a.Close() // a crash

	a, again, err := openArena(o, sp, opts, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if again.dir != place.dir || again.write || a.Journal().Len() != 1 {
		t.Fatalf("restart opened %+v (journal %d), want %s through the pointer", again, a.Journal().Len(), place.dir)
	}
	again.undoPointer() // a failed start keeps a pointer it did not write
	if readPointer(sp.path+".arena", preferred+"-") != place.dir {
		t.Fatal("undo removed the pointer to a journal")
	}
	a.Journal().Delete("staged")
	a.Remove()
	again.removePointer()
	if _, err := os.Stat(sp.path + ".arena"); !os.IsNotExist(err) {
		t.Fatalf("pointer left after its arena was removed: %v", err)
	}

	// With a socket folder others may write, a pointer could be forged:
	// a taken name is an error.
	sp.private = false
	if _, _, err := openArena(o, sp, opts, quiet); !errors.Is(err, arena.ErrNotOurs) || !strings.Contains(err.Error(), "--arena-dir") {
		t.Fatalf("taken name, shared socket folder: %v", err)
	}
	if ents, _ := os.ReadDir(shm); len(ents) != 1 {
		t.Fatalf("/dev/shm stand-in holds %v, want only the planted link", ents)
	}
}

// The name used before the uid was part of it is still found.
func TestDefaultArenaLegacyName(t *testing.T) {
	shm := useShm(t)
	sockDir := t.TempDir()
	sp := &socketPlace{path: filepath.Join(sockDir, "ckptd.sock"), dir: sockDir, private: true}
	a, place, err := openArena(&Options{}, sp, arena.Options{Size: 1 << 20, Logger: quiet}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	a.Remove()
	legacy := filepath.Join(shm, "ckptd-"+strings.TrimPrefix(filepath.Base(place.dir), fmt.Sprintf("ckptd-%d-", os.Getuid())))
	os.Mkdir(legacy, 0o700)
	a, place, err = openArena(&Options{}, sp, arena.Options{Size: 1 << 20, Logger: quiet}, quiet)
	if err != nil || place.dir != legacy {
		t.Fatalf("opened %+v, %v; want the legacy %s", place, err, legacy)
	}
	a.Remove()
}

// tree lists every path under dir, relative to it.
func tree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(dir, func(p string, _ os.DirEntry, err error) error {
		if err == nil {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return nil
	})
	return out
}

// serveOpts are options for an in-process serve on storage under dir.
func serveOpts(dir, socket string) *Options {
	return &Options{
		URL: filepath.Join(dir, "store"), Job: "j",
		Socket: socket, StagingBytes: 4 << 20, ChunkSize: 1 << 20, Codec: "auto",
		Drains: 1, Workers: 1, Grace: time.Second, RingSlots: 1, SlotBytes: 1 << 20,
		StagingWait: time.Second, LeaseTimeout: time.Minute,
	}
}

// A start that fails at any step leaves the socket folder and /dev/shm as
// they were: no arena, no socket, no folder it made. Then a start that
// succeeds still can.
func TestFailedServeLeavesNothing(t *testing.T) {
	shm := useShm(t)
	sockDir := useTmpRoot(t) // the default socket: serve makes its folder
	slog.SetDefault(quiet)
	defer func() { startupFault = nil }()
	steps := []string{"storage", "arena", "manager", "prefetch", "listen"}
	for _, step := range steps {
		t.Run(step, func(t *testing.T) {
			dir := t.TempDir()
			injected := errors.New("injected at " + step)
			startupFault = func(s string) error {
				if s == step {
					return injected
				}
				return nil
			}
			if err := Run(context.Background(), serveOpts(dir, "")); !errors.Is(err, injected) {
				t.Fatalf("Run = %v", err)
			}
			if got := tree(t, shm); !slices.Equal(got, []string{"."}) {
				t.Errorf("/dev/shm stand-in holds %q", got)
			}
			if _, err := os.Lstat(sockDir); !os.IsNotExist(err) {
				t.Errorf("socket folder %s left: %q", sockDir, tree(t, sockDir))
			}
		})
	}

	// Folders made for an explicit --socket go too.
	root := t.TempDir()
	startupFault = func(s string) error { return errors.New("injected at " + s) }
	Run(context.Background(), serveOpts(t.TempDir(), filepath.Join(root, "a", "b", "ckptd.sock")))
	if got := tree(t, root); !slices.Equal(got, []string{"."}) {
		t.Errorf("socket folders left: %q", got)
	}

	// A failed start over a crashed daemon's journal keeps the journal.
	startupFault = nil
	socket := filepath.Join(t.TempDir(), "ckptd.sock")
	sp := &socketPlace{path: socket, dir: filepath.Dir(socket), private: true}
	a, place, err := openArena(&Options{}, sp, arena.Options{Size: 4 << 20, Logger: quiet}, quiet)
	if err != nil {
		t.Fatal(err)
	}
	a.Journal().Put("staged", []byte("not a journal entry the core can read"))
	a.Close()
	// The manager sets the unreadable entry aside (quarantine) as soon as
	// it starts, and once the journal is empty the next start makes the
	// arena file anew (a failed start then takes the new one back); apart
	// from that, nothing may change.
	settled := func(paths []string) []string {
		return slices.DeleteFunc(paths, func(p string) bool {
			return strings.HasSuffix(p, "/journal/staged") || strings.Contains(p, "/journal/quarantine") || strings.HasSuffix(p, "/arena")
		})
	}
	before := settled(tree(t, shm))
	for _, step := range steps[1:] {
		startupFault = func(s string) error {
			if s == step {
				return errors.New("injected")
			}
			return nil
		}
		Run(context.Background(), serveOpts(t.TempDir(), socket))
		if got := settled(tree(t, shm)); !slices.Equal(got, before) {
			t.Fatalf("failed at %s: arena was %q, now %q", step, before, got)
		}
	}
	startupFault = nil
	a, err = arena.Open(arena.Options{Dir: place.dir, Size: 4 << 20, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	_ = a.Journal().Delete("staged") // quarantined already, unless no start got that far
	a.Close()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, serveOpts(t.TempDir(), socket)) }()
	testtime.Until(t, time.Minute, "serve comes up after the failed starts", func() bool {
		live, _, _ := probeSocket(socket)
		return live
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(socket); !os.IsNotExist(err) {
		t.Errorf("socket left after shutdown: %v", err)
	}
	if got := tree(t, shm); !slices.Equal(got, []string{"."}) {
		t.Errorf("arena left after a clean shutdown: %q", got)
	}
}
