package arena

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"golang.org/x/sys/unix"
)

// fileSystems are where the arena directory may live: tmpfs in production,
// an ordinary disk (t.TempDir) in development.
func fileSystems(t *testing.T) map[string]func(t *testing.T) string {
	return map[string]func(t *testing.T) string{
		"disk": func(t *testing.T) string { return filepath.Join(t.TempDir(), "arena") },
		"tmpfs": func(t *testing.T) string {
			parent, err := os.MkdirTemp("/dev/shm", "ckptd-arena-test-")
			if err != nil {
				t.Skipf("no /dev/shm: %v", err)
			}
			t.Cleanup(func() { os.RemoveAll(parent) })
			return filepath.Join(parent, "arena")
		},
	}
}

func eachFS(t *testing.T, f func(t *testing.T, dir string)) {
	for name, mkdir := range fileSystems(t) {
		t.Run(name, func(t *testing.T) { f(t, mkdir(t)) })
	}
}

// logBuffer collects log output from concurrent goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func testLogger() (*slog.Logger, *logBuffer) {
	var b logBuffer
	return slog.New(slog.NewTextHandler(&b, nil)), &b
}

func mustOpen(t *testing.T, opts Options) *Arena {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger, _ = testLogger()
	}
	a, err := Open(opts)
	if err != nil {
		t.Fatalf("Open(%+v): %v", opts, err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func TestOpenCreates(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: 8*mib + 123})
		if a.Size() != 8*mib {
			t.Errorf("Size() = %d, want the budget rounded down to a page, %d", a.Size(), 8*mib)
		}
		if a.Path() != filepath.Join(dir, "arena") {
			t.Errorf("Path() = %s", a.Path())
		}
		if len(a.Bytes()) != int(a.Size()) {
			t.Errorf("len(Bytes()) = %d", len(a.Bytes()))
		}
		checkMode(t, dir, os.ModeDir|0o700)
		checkMode(t, a.Path(), 0o600)
		fi, err := os.Stat(a.Path())
		if err != nil || fi.Size() != a.Size() {
			t.Fatalf("arena file: %v, %v", fi, err)
		}
		// fallocate, not a sparse file: the blocks exist already.
		if st := fi.Sys().(*syscall.Stat_t); st.Blocks*512 < a.Size() {
			t.Errorf("arena file has %d bytes allocated, want all %d", st.Blocks*512, a.Size())
		}
		pid, _ := os.ReadFile(filepath.Join(dir, "lock"))
		if strings.TrimSpace(string(pid)) != fmt.Sprint(os.Getpid()) {
			t.Errorf("lock file holds %q, want our pid", pid)
		}
		if a.Available() != a.Size() || a.Used() != 0 {
			t.Errorf("Available %d Used %d", a.Available(), a.Used())
		}
	})
}

func checkMode(t *testing.T, path string, want os.FileMode) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode() != want {
		t.Errorf("%s: mode %v, want %v", path, fi.Mode(), want)
	}
}

func TestOpenTightensDirMode(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o777)
	mustOpen(t, Options{Dir: dir, Size: 1 * mib})
	checkMode(t, dir, os.ModeDir|0o700)
}

// Bad options fail; a directory that is not ours (a symlink or a file at
// its path, one owned by another user) fails with ErrNotOurs, so that the
// daemon can pick another name.
func TestOpenRejects(t *testing.T) {
	tmp := t.TempDir()
	symlink := filepath.Join(tmp, "link")
	os.Symlink(t.TempDir(), symlink)
	file := filepath.Join(tmp, "file")
	os.WriteFile(file, nil, 0o600)
	type rejectCase struct {
		name    string
		opts    Options
		notOurs bool
	}
	tests := []rejectCase{
		{"no dir", Options{Size: mib}, false},
		{"zero size", Options{Dir: filepath.Join(tmp, "a"), Size: 0}, false},
		{"below a page", Options{Dir: filepath.Join(tmp, "b"), Size: 4095}, false},
		{"symlink dir", Options{Dir: symlink, Size: mib}, true},
		{"file as dir", Options{Dir: file, Size: mib}, true},
	}
	if os.Geteuid() == 0 {
		other := filepath.Join(tmp, "other")
		os.Mkdir(other, 0o700)
		if err := os.Chown(other, 12345, 12345); err != nil {
			t.Fatal(err)
		}
		tests = append(tests, rejectCase{"another user's dir", Options{Dir: other, Size: mib}, true})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := Open(tt.opts)
			if err == nil {
				a.Close()
				t.Fatal("Open succeeded")
			}
			if errors.Is(err, ErrNotOurs) != tt.notOurs {
				t.Fatalf("Open = %v; ErrNotOurs: %v, want %v", err, errors.Is(err, ErrNotOurs), tt.notOurs)
			}
		})
	}
}

func TestReopenPreservesContent(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: 4 * mib})
		r, err := a.Alloc(context.Background(), 3*mib)
		if err != nil {
			t.Fatal(err)
		}
		payload := bytes.Repeat([]byte("staged shard "), 1000)
		copy(a.Bytes()[r.Offset:], payload)
		if err := a.Journal().Put("save-1", []byte(fmt.Sprintf(`{"offset":%d,"length":%d}`, r.Offset, r.Length))); err != nil {
			t.Fatal(err)
		}
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}

		for _, size := range []int64{4 * mib, 8 * mib} { // same size, then a new one
			log, logs := testLogger()
			b := mustOpen(t, Options{Dir: dir, Size: size, Logger: log})
			if b.Size() != 4*mib {
				t.Fatalf("reopen with size %d: Size() = %d, want the journaled arena's %d", size, b.Size(), 4*mib)
			}
			if size != 4*mib && !strings.Contains(logs.String(), "level=WARN") {
				t.Errorf("no warning about keeping the old size: %s", logs)
			}
			if got := b.Bytes()[r.Offset : r.Offset+int64(len(payload))]; !bytes.Equal(got, payload) {
				t.Fatal("staged bytes lost on reopen")
			}
			if b.Journal().Len() != 1 {
				t.Fatalf("journal has %d entries, want 1", b.Journal().Len())
			}
			if err := b.Reserve(r); err != nil {
				t.Fatalf("recovery reserve: %v", err)
			}
			if err := b.Close(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

func TestReopenWarnsWhenArenaFileLost(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	a := mustOpen(t, Options{Dir: dir, Size: mib})
	a.Journal().Put("orphan", nil)
	a.Close()
	os.Remove(a.Path())
	log, logs := testLogger()
	b := mustOpen(t, Options{Dir: dir, Size: mib, Logger: log})
	if b.Size() != mib || !strings.Contains(logs.String(), "level=WARN") {
		t.Fatalf("Size %d, log: %s", b.Size(), logs)
	}
}

func TestReopenResizesWhenJournalEmpty(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: 4 * mib})
		copy(a.Bytes(), "old")
		a.Close()

		for _, size := range []int64{8 * mib, 2 * mib} {
			b := mustOpen(t, Options{Dir: dir, Size: size})
			if b.Size() != size || int64(len(b.Bytes())) != size {
				t.Fatalf("Size() = %d, len(Bytes()) = %d, want %d", b.Size(), len(b.Bytes()), size)
			}
			if fi, _ := os.Stat(b.Path()); fi.Size() != size {
				t.Fatalf("file is %d bytes, want %d", fi.Size(), size)
			}
			if !bytes.Equal(b.Bytes()[:3], make([]byte, 3)) {
				t.Fatal("old content survived a resize: the file was not recreated")
			}
			b.Close()
		}
	})
}

func TestOpenInUse(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: mib})
		_, err := Open(Options{Dir: dir, Size: mib})
		if !errors.Is(err, ErrInUse) {
			t.Fatalf("second Open = %v, want ErrInUse", err)
		}
		for _, want := range []string{filepath.Join(dir, "lock"), fmt.Sprint(os.Getpid())} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not name %s", err, want)
			}
		}
		if a.Journal().Put("x", nil) != nil || int64(len(a.Bytes())) != mib {
			t.Fatal("failed Open disturbed the open arena")
		}
		a.Journal().Delete("x")
		a.Close()
		b := mustOpen(t, Options{Dir: dir, Size: mib})
		b.Close()
	})
}

func TestClose(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	a := mustOpen(t, Options{Dir: dir, Size: mib})
	if err := a.Journal().Put("keep", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if a.Bytes() != nil {
		t.Error("Bytes() after Close")
	}
	if _, err := a.Alloc(context.Background(), 1); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close = %v", err)
	}
	if err := a.Journal().Put("y", nil); !errors.Is(err, ErrClosed) {
		t.Errorf("Put after Close = %v", err)
	}
	for _, name := range []string{"arena", "lock", "journal/keep"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("Close removed %s: %v", name, err)
		}
	}
	if err := a.Remove(); !errors.Is(err, ErrClosed) {
		t.Errorf("Remove after Close = %v", err)
	}
}

func TestRemove(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: mib})
		a.Journal().Put("pending", []byte("{}"))
		if err := a.Remove(); !errors.Is(err, ErrJournalNotEmpty) {
			t.Fatalf("Remove with a journal entry = %v, want ErrJournalNotEmpty", err)
		}
		if int64(len(a.Bytes())) != mib {
			t.Fatal("a refused Remove closed the arena")
		}
		a.Journal().Delete("pending")
		if err := a.Remove(); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Fatalf("dir still there: %v", err)
		}
	})
}

func TestLockMemory(t *testing.T) {
	log, logs := testLogger()
	a := mustOpen(t, Options{Dir: filepath.Join(t.TempDir(), "a"), Size: 16 * mib, Lock: true, Logger: log})
	if a.Locked() {
		t.Log("mlock succeeded")
		return
	}
	out := logs.String()
	t.Logf("mlock failed, warned: %s", out)
	for _, want := range []string{"level=WARN", "bytes=16777216", "memlock_limit=", "ulimit -l", "LimitMEMLOCK", "CAP_IPC_LOCK"} {
		if !strings.Contains(out, want) {
			t.Errorf("mlock warning lacks %q: %s", want, out)
		}
	}
}

func TestArenaAllocConcurrent(t *testing.T) {
	a := mustOpen(t, Options{Dir: filepath.Join(t.TempDir(), "a"), Size: 8 * mib})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				r, err := a.Alloc(context.Background(), int64(1+(g*50+i)%3)*mib)
				if err != nil {
					t.Error(err)
					return
				}
				mem := a.Bytes()[r.Offset : r.Offset+r.Length]
				mem[0], mem[len(mem)-1] = byte(g), byte(g)
				if mem[0] != byte(g) || mem[len(mem)-1] != byte(g) {
					t.Error("region shared with another goroutine")
				}
				if err := a.Free(r); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if a.Used() != 0 {
		t.Fatalf("Used() = %d after all frees", a.Used())
	}
}

// TestOpenShared: a shared arena is open to its group (to map, not to
// take over: the lock and journal stay private), and reopening it
// unshared makes it private again.
func TestOpenShared(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	gid := os.Getgid() // a group we may give files to without privileges
	a := mustOpen(t, Options{Dir: dir, Size: 1 * mib, Shared: true, SharedGID: gid})
	checkMode(t, dir, os.ModeDir|0o750)
	checkMode(t, a.Path(), 0o660)
	checkMode(t, filepath.Join(dir, "journal"), os.ModeDir|0o700)
	checkMode(t, filepath.Join(dir, "lock"), 0o600)
	for _, p := range []string{dir, a.Path()} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if g := int(fi.Sys().(*syscall.Stat_t).Gid); g != gid {
			t.Errorf("%s: group %d, want %d", p, g, gid)
		}
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a = mustOpen(t, Options{Dir: dir, Size: 1 * mib})
	checkMode(t, dir, os.ModeDir|0o700)
	checkMode(t, a.Path(), 0o600)
}

// With DeferShare a shared arena stays private until Share: a daemon reads
// what an earlier process staged before any member can write it.
func TestDeferShare(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	gid := os.Getgid()
	a := mustOpen(t, Options{Dir: dir, Size: 1 * mib, Shared: true, SharedGID: gid, DeferShare: true})
	checkMode(t, dir, os.ModeDir|0o700)
	checkMode(t, a.Path(), 0o600)
	if err := a.Share(); err != nil {
		t.Fatal(err)
	}
	checkMode(t, dir, os.ModeDir|0o750)
	checkMode(t, a.Path(), 0o660)
	if err := a.Share(); err != nil { // once is enough; again does nothing
		t.Fatal(err)
	}
}

// A crashed daemon's arena file is replaced when nothing is staged in it,
// so that a client still writing through its old mapping cannot reach the
// regions the new daemon hands out; it is kept (Reused) when its journal
// holds saves. Every opening has its own id.
func TestReopenReplacesOrReuses(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	a := mustOpen(t, Options{Dir: dir, Size: 1 << 20})
	if a.Reused() {
		t.Fatal("a new arena reports Reused")
	}
	stale := clientMap(t, a.Path(), 1<<20)
	id := a.ID()
	a.Close()
	b := mustOpen(t, Options{Dir: dir, Size: 1 << 20})
	if b.ID() == id || b.Reused() {
		t.Fatalf("reopened with an empty journal: id %s (was %s), reused %v", b.ID(), id, b.Reused())
	}
	stale[4096] = 0xab // a dead daemon's client finishing its copy
	if b.Bytes()[4096] == 0xab {
		t.Fatal("a stale mapping reaches the new arena")
	}
	if err := b.Journal().Put("staged", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	kept := clientMap(t, b.Path(), 1<<20)
	b.Close()
	c := mustOpen(t, Options{Dir: dir, Size: 1 << 20})
	defer c.Close()
	if !c.Reused() || c.ID() == b.ID() {
		t.Fatalf("reopened with a staged save: reused %v, id %s (was %s)", c.Reused(), c.ID(), b.ID())
	}
	kept[8192] = 0xcd
	if c.Bytes()[8192] != 0xcd {
		t.Fatal("the kept arena is not the same file")
	}
}

func clientMap(t *testing.T, path string, size int) []byte {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return mem
}

// On an arena kept from a crashed daemon that recorded no writers'
// regions (one that predates the record), Alloc waits out the fence for
// every user, since any of the dead daemon's clients may still be copying;
// Reserve (recovery) does not; a fresh arena is not fenced.
func TestCrashFenceWhole(t *testing.T) {
	dir := t.TempDir()
	a := mustOpen(t, Options{Dir: dir, Size: 4 * mib, Fence: time.Hour})
	start := time.Now()
	r, err := a.Alloc(context.Background(), 64<<10)
	if err != nil || time.Since(start) > testtime.Scale(5*time.Second) {
		t.Fatalf("a fresh arena is fenced: %v after %s", err, time.Since(start))
	}
	if err := a.Journal().Put("save-1", []byte("{}")); err != nil { // something staged, so the file is kept
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, writersDir)); err != nil { // as a daemon that kept no record left it
		t.Fatal(err)
	}
	b := mustOpen(t, Options{Dir: dir, Size: 4 * mib, Fence: 300 * time.Millisecond})
	defer b.Close()
	if err := b.Reserve(r); err != nil {
		t.Fatalf("recovery waits for the fence: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := b.Alloc(ctx, 64<<10); !errors.Is(err, ErrFull) || !strings.Contains(err.Error(), "fenced") {
		t.Fatalf("an Alloc that cannot wait out the fence: %v", err)
	}
	start = time.Now()
	if _, err := b.Alloc(context.Background(), 64<<10); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < 200*time.Millisecond {
		t.Fatalf("a region on a crashed daemon's arena after %s, inside the fence", waited)
	}
}

// populate maps a file with every page allocated, keeping the bytes of
// pages already there (an arena kept from a crash), and fails, as a file
// system too small for the arena does, when a page cannot be had (here:
// pages beyond the end of the file, whose fault is the same SIGBUS).
func TestPopulate(t *testing.T) {
	f, err := os.CreateTemp("/dev/shm", "ckptd-populate-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err := f.Write([]byte("kept bytes")); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(4 * pageSize); err != nil {
		t.Fatal(err)
	}
	mem, err := populate(f, 4*pageSize)
	if err != nil {
		t.Fatal(err)
	}
	if string(mem[:10]) != "kept bytes" {
		t.Fatalf("populate changed the bytes there: %q", mem[:10])
	}
	unix.Munmap(mem)
	if err := f.Truncate(pageSize); err != nil {
		t.Fatal(err)
	}
	if mem, err := populate(f, 4*pageSize); err == nil || !strings.Contains(err.Error(), "big enough") {
		if err == nil {
			unix.Munmap(mem)
		}
		t.Fatalf("populate past what the file can hold: %v", err)
	}
}
