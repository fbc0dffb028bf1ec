package posix_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
	"github.com/ckptd/ckptd/storage/storagetest"
)

// newBackend returns a backend on a fresh directory under parent ("" for
// t.TempDir()) and checks, when the test ends, that no temporary file is
// left.
func newBackend(t *testing.T, parent string, opts posix.Options) *posix.Backend {
	t.Helper()
	dir := t.TempDir()
	if parent != "" {
		var err error
		if dir, err = os.MkdirTemp(parent, "ckptd-posix-test-"); err != nil {
			t.Skipf("no directory under %s: %v", parent, err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	b := open(t, dir, opts)
	t.Cleanup(func() { checkNoTemps(t, dir) })
	return b
}

// open opens a backend on root and closes it when the test ends, before
// the cleanups registered earlier (unmounting root) run.
func open(t *testing.T, root string, opts posix.Options) *posix.Backend {
	t.Helper()
	b, err := posix.NewWithOptions(root, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return b
}

func checkNoTemps(t *testing.T, root string) {
	t.Helper()
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if strings.Contains(d.Name(), ".tmp-") {
			t.Errorf("temporary file left behind: %s", p)
		}
		return nil
	})
	if err != nil {
		t.Errorf("walking %s: %v", root, err)
	}
}

func TestConformance(t *testing.T) {
	tests := []struct {
		name   string
		parent string
		opts   posix.Options
		setup  func(testing.TB)
	}{
		{"disk-direct", "", posix.Options{DirectIO: true}, nil},
		{"disk-buffered", "", posix.Options{}, nil},
		{"disk-no-direct-support", "", posix.Options{DirectIO: true}, posix.SimulateNoDirectIO},
		{"shm-direct", "/dev/shm", posix.Options{DirectIO: true}, nil},
		{"disk-no-openat2", "", posix.Options{DirectIO: true}, posix.SimulateNoOpenat2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.setup != nil {
				tt.setup(t)
			}
			storagetest.Run(t, func(t *testing.T) storage.Backend {
				return newBackend(t, tt.parent, tt.opts)
			})
		})
	}
}

func patterned(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131 + i>>12)
	}
	return b
}

func readObject(t *testing.T, b storage.Backend, name string) []byte {
	t.Helper()
	rc, err := b.Get(t.Context(), name, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// supportsDirect reports whether dir's file system accepts O_DIRECT.
func supportsDirect(t *testing.T, dir string) bool {
	err := posix.WriteDirect(filepath.Join(dir, "probe"), []byte("x"))
	os.Remove(filepath.Join(dir, "probe"))
	if err != nil && !errors.Is(err, posix.ErrDirectIOUnsupported) {
		t.Fatal(err)
	}
	return err == nil
}

// TestDirectIO writes sizes that end in a partial block, so that both the
// O_DIRECT blocks and the buffered tail are exercised, on a disk and on
// tmpfs, and checks which path was taken.
func TestDirectIO(t *testing.T) {
	const odd = 8<<20 + 3*4096 + 123
	for _, parent := range []string{"", "/dev/shm"} {
		t.Run(fmt.Sprintf("parent=%q", parent), func(t *testing.T) {
			b := newBackend(t, parent, posix.Options{DirectIO: true})
			direct := supportsDirect(t, b.Root())
			t.Logf("O_DIRECT supported: %v", direct)
			puts := 0
			for _, tt := range []struct {
				size  int
				known bool
				big   bool // at least the threshold, or of unknown size
			}{
				{odd, true, true},
				{odd, false, true},
				{12 << 20, true, true},
				{4096 + 1, false, true},
				{100, false, true},
				{0, false, true},
				{5 << 20, true, false},
			} {
				data := patterned(tt.size)
				size := int64(-1)
				if tt.known {
					size = int64(tt.size)
				}
				name := fmt.Sprintf("d/%d-%v", tt.size, tt.known)
				if err := b.Put(t.Context(), name, struct{ io.Reader }{bytes.NewReader(data)}, size); err != nil {
					t.Fatalf("Put %s: %v", name, err)
				}
				if !bytes.Equal(readObject(t, b, name), data) {
					t.Fatalf("%s: contents differ", name)
				}
				if tt.big {
					puts++
				}
			}
			wantDirect, wantFallback := int64(puts), int64(0)
			if !direct {
				wantDirect, wantFallback = 0, int64(puts)
			}
			if b.DirectWrites() != wantDirect || b.DirectFallbacks() != wantFallback {
				t.Errorf("direct writes %d, fallbacks %d; want %d, %d",
					b.DirectWrites(), b.DirectFallbacks(), wantDirect, wantFallback)
			}
		})
	}
}

func TestDirectIOFallback(t *testing.T) {
	posix.SimulateNoDirectIO(t)
	b := newBackend(t, "", posix.Options{DirectIO: true})
	data := patterned(9<<20 + 77)
	if err := b.Put(t.Context(), "f/obj", bytes.NewReader(data), -1); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readObject(t, b, "f/obj"), data) {
		t.Fatal("contents differ")
	}
	if b.DirectWrites() != 0 || b.DirectFallbacks() != 1 {
		t.Errorf("direct writes %d, fallbacks %d; want 0, 1", b.DirectWrites(), b.DirectFallbacks())
	}
}

// mountFS mounts a small file system of the given type for the test, or
// skips the test where mounting is not allowed (not root, a container).
func mountFS(t *testing.T, fstype, options string) string {
	dir := t.TempDir()
	if err := syscall.Mount(fstype, dir, fstype, 0, options); err != nil {
		t.Skipf("cannot mount %s here: %v", fstype, err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

// TestDirectIOFallbackRamfs uses a real file system without O_DIRECT.
func TestDirectIOFallbackRamfs(t *testing.T) {
	root := mountFS(t, "ramfs", "")
	b := open(t, root, posix.Options{DirectIO: true})
	data := patterned(9<<20 + 77)
	if err := b.Put(t.Context(), "f/obj", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readObject(t, b, "f/obj"), data) {
		t.Fatal("contents differ")
	}
	if b.DirectFallbacks() != 1 {
		t.Errorf("fallbacks %d, want 1", b.DirectFallbacks())
	}
	if err := posix.WriteDirect(filepath.Join(root, "raw"), data); !errors.Is(err, posix.ErrDirectIOUnsupported) {
		t.Errorf("WriteDirect on ramfs = %v, want ErrDirectIOUnsupported", err)
	}
	checkNoTemps(t, root)
}

func TestNoSpace(t *testing.T) {
	root := mountFS(t, "tmpfs", "size=1m")
	for _, opts := range []posix.Options{{DirectIO: true}, {}} {
		b := open(t, root, opts)
		data := patterned(2 << 20)
		err := b.Put(t.Context(), "full/obj", bytes.NewReader(data), -1)
		if !errors.Is(err, storage.ErrNoSpace) || !errors.Is(err, syscall.ENOSPC) {
			t.Fatalf("Put of 2 MiB into 1 MiB = %v, want ErrNoSpace wrapping ENOSPC", err)
		}
		err = b.PutIfAbsent(t.Context(), "full/obj", data)
		if !errors.Is(err, storage.ErrNoSpace) {
			t.Fatalf("PutIfAbsent of 2 MiB into 1 MiB = %v, want ErrNoSpace", err)
		}
		checkNoTemps(t, root)
		if entries, _ := os.ReadDir(root); len(entries) != 0 {
			t.Fatalf("root not empty after failed puts: %v", entries)
		}
	}
}

func TestWrapErr(t *testing.T) {
	tests := []struct {
		err     error
		noSpace bool
	}{
		{syscall.ENOSPC, true},
		{syscall.EDQUOT, true},
		{&fs.PathError{Op: "write", Path: "/x", Err: syscall.ENOSPC}, true},
		{fmt.Errorf("deep: %w", &os.SyscallError{Syscall: "fsync", Err: syscall.EDQUOT}), true},
		{syscall.EIO, false},
		{errors.New("other"), false},
	}
	for _, tt := range tests {
		err := posix.WrapErr("put", "a/b", tt.err)
		if errors.Is(err, storage.ErrNoSpace) != tt.noSpace {
			t.Errorf("WrapErr(%v) = %v; ErrNoSpace %v, want %v", tt.err, err, !tt.noSpace, tt.noSpace)
		}
		if !errors.Is(err, tt.err) || !strings.Contains(err.Error(), `"a/b"`) {
			t.Errorf("WrapErr(%v) = %v; want it to wrap the cause and name the object", tt.err, err)
		}
	}
}

// TestNoTempsAfterFailures checks on disk what the suite can only check
// through the interface.
func TestNoTempsAfterFailures(t *testing.T) {
	b := newBackend(t, "", posix.Options{DirectIO: true})
	ctx := t.Context()
	big := patterned(9 << 20)
	_ = b.Put(ctx, "new/dir/short", bytes.NewReader(big), int64(len(big))+1)
	_ = b.Put(ctx, "new/dir/long", bytes.NewReader(big), int64(len(big))-1)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_ = b.Put(cctx, "new/dir/cancelled", bytes.NewReader(big), -1)
	_ = b.Put(ctx, "new/dir/readerr", io.MultiReader(bytes.NewReader(big), errReader{}), -1)
	if entries, _ := os.ReadDir(b.Root()); len(entries) != 0 {
		t.Errorf("failed puts left %v in the root", entries)
	}
	if err := b.PutIfAbsent(ctx, "x/commit", []byte("1")); err != nil {
		t.Fatal(err)
	}
	if err := b.PutIfAbsent(ctx, "x/commit", []byte("2")); !errors.Is(err, storage.ErrExists) {
		t.Fatalf("second PutIfAbsent = %v", err)
	}
	// checkNoTemps runs at cleanup.
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("read failed") }

// TestPutIfAbsentWithoutHardLinks runs the suite with PutIfAbsent
// publishing through renameat2(RENAME_NOREPLACE).
func TestPutIfAbsentWithoutHardLinks(t *testing.T) {
	posix.SimulateNoHardLinks(t)
	storagetest.Run(t, func(t *testing.T) storage.Backend {
		return newBackend(t, "", posix.Options{DirectIO: true})
	})
}

func TestTempNames(t *testing.T) {
	for _, base := range []string{"a", "rank-00000.data", strings.Repeat("z", storage.MaxSegmentLen)} {
		n := posix.TempName(base)
		if len(n) > storage.MaxSegmentLen || !posix.IsTempName(n) {
			t.Errorf("TempName(%.20q…) = %q: too long or not recognised", base, n)
		}
	}
	for _, tt := range []struct {
		name string
		temp bool
	}{
		{".a.tmp-0123456789abcdef", true},
		{"...tmp-0123456789abcdef", true},
		{"..tmp-0123456789abcdef", false},
		{"a.tmp-0123456789abcdef", false},
		{".a.tmp-0123456789ABCDEF", false},
		{".a.tmp-0123456789abcde", false},
		{".a.tmp-0123456789abcdefg", false},
		{".tmp-0123456789abcdef", false},
	} {
		if got := posix.IsTempName(tt.name); got != tt.temp {
			t.Errorf("IsTempName(%q) = %v, want %v", tt.name, got, tt.temp)
		}
	}
	b := newBackend(t, "", posix.Options{})
	err := b.Put(t.Context(), "a/.x.tmp-0123456789abcdef", bytes.NewReader(nil), 0)
	if !errors.Is(err, storage.ErrInvalidName) {
		t.Errorf("Put of a temporary-file name = %v, want ErrInvalidName", err)
	}
}

func TestDeleteRemovesEmptyDirs(t *testing.T) {
	b := newBackend(t, "", posix.Options{})
	ctx := t.Context()
	for _, n := range []string{"a/b/c/obj", "a/keep"} {
		if err := b.Put(ctx, n, bytes.NewReader(nil), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Delete(ctx, "a/b/c/obj"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(b.Root(), "a/b")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a/b still there after deleting its only object: %v", err)
	}
	if err := b.Delete(ctx, "a/keep"); err != nil {
		t.Fatal(err)
	}
	if entries, err := os.ReadDir(b.Root()); err != nil || len(entries) != 0 {
		t.Errorf("root after deleting everything: %v, %v; want empty and present", entries, err)
	}
}

// TestNameConflicts: on a file system a name cannot be both an object and
// a directory of objects; the failure must be clean.
func TestNameConflicts(t *testing.T) {
	b := newBackend(t, "", posix.Options{})
	ctx := t.Context()
	if err := b.Put(ctx, "x/y", bytes.NewReader([]byte("y")), 1); err != nil {
		t.Fatal(err)
	}
	if err := b.Put(ctx, "x", bytes.NewReader([]byte("x")), 1); err == nil {
		t.Error("Put over a directory succeeded")
	}
	if err := b.Put(ctx, "x/y/z", bytes.NewReader([]byte("z")), 1); err == nil {
		t.Error("Put below an object succeeded")
	}
	if err := b.PutIfAbsent(ctx, "x", []byte("x")); err == nil {
		t.Error("PutIfAbsent over a directory succeeded")
	}
	if _, err := b.Stat(ctx, "x"); !errors.Is(err, storage.ErrNotFound) {
		t.Errorf("Stat of a directory = %v, want ErrNotFound", err)
	}
	if err := b.Delete(ctx, "x"); err != nil {
		t.Errorf("Delete of a directory = %v, want nil (no such object)", err)
	}
	if fi, err := os.Stat(filepath.Join(b.Root(), "x")); err != nil || !fi.IsDir() {
		t.Errorf("Delete of a name that is a directory removed it: %v", err)
	}
}

func TestNew(t *testing.T) {
	root := filepath.Join(t.TempDir(), "new", "root")
	b := open(t, root, posix.Options{DirectIO: true})
	if fi, err := os.Stat(root); err != nil || !fi.IsDir() {
		t.Fatalf("New did not create the root: %v", err)
	}
	if got, want := b.Location(), "file://"+root; got != want {
		t.Errorf("Location() = %q, want %q", got, want)
	}
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, err := posix.New(file); err == nil {
		t.Error("New on a regular file succeeded")
	}
	if _, err := posix.New(""); err == nil {
		t.Error("New with an empty root succeeded")
	}
}

func TestWriteDirect(t *testing.T) {
	dir := t.TempDir()
	if !supportsDirect(t, dir) {
		t.Skip("the test directory's file system does not support O_DIRECT")
	}
	data := patterned(10<<20 + 4096 + 5)
	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"small", data[:100]},
		{"one-block", data[:4096]},
		{"large", data},
		{"large-unaligned-memory", data[1:]},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(dir, tt.name)
			if err := posix.WriteDirect(p, tt.data); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(p)
			if err != nil || !bytes.Equal(got, tt.data) {
				t.Fatalf("read back %d bytes (%v), want %d", len(got), err, len(tt.data))
			}
		})
	}
	posix.SimulateNoDirectIO(t)
	if err := posix.WriteDirect(filepath.Join(dir, "no"), data); !errors.Is(err, posix.ErrDirectIOUnsupported) {
		t.Errorf("WriteDirect without O_DIRECT = %v, want ErrDirectIOUnsupported", err)
	}
}

// TestListDirsSkipsDirsWithoutObjects: a folder counts as a directory only
// if List would list something below it, and links are not objects.
func TestListDirsSkipsDirsWithoutObjects(t *testing.T) {
	root := t.TempDir()
	b := open(t, root, posix.Options{DirectIO: true})
	mk := func(p string) string {
		p = filepath.Join(root, filepath.FromSlash(p))
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	mk("s/empty/nested")
	if err := os.WriteFile(filepath.Join(mk("s/temponly"), ".x.tmp-0123456789abcdef"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mk("s/deep/a/b"), "obj"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../deep/a/b/obj", filepath.Join(mk("s/link"), "l")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("missing", filepath.Join(mk("s/dangling"), "l")); err != nil {
		t.Fatal(err)
	}
	var got []string
	if err := b.ListDirs(t.Context(), "s/", func(seg string) error { got = append(got, seg); return nil }); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{"deep"}) {
		t.Fatalf("ListDirs(s/) = %q, want [deep]", got)
	}
}

// A writer killed mid-Put leaves its temporary file: ListTemporaries shows
// it as the object it would have become, with its size and last write,
// List never does, and DeleteTemporary removes it and the folders it
// leaves empty, refusing names not of its form and links.
func TestLeftoverTemporaries(t *testing.T) {
	b := newBackend(t, "", posix.Options{})
	ctx := t.Context()
	mustPut := func(name string, data []byte) {
		t.Helper()
		if err := b.Put(ctx, name, bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatal(err)
		}
	}
	mustPut("job/steps/1/a/rank-00000.data", []byte("published"))
	// What a kill -9 leaves: a file of the temporary form, beside objects
	// and alone in a folder of its own.
	leftovers := map[string]int{
		"job/steps/1/a/.rank-00001.data.tmp-0123456789abcdef": 5000,
		"job/steps/2/b/.rank-00000.data.tmp-fedcba9876543210": 7,
	}
	for rel, n := range leftovers {
		p := filepath.Join(b.Root(), rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, n), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	old := time.Now().Add(-3 * time.Hour)
	if err := os.Chtimes(filepath.Join(b.Root(), "job/steps/2/b/.rank-00000.data.tmp-fedcba9876543210"), old, old); err != nil {
		t.Fatal(err)
	}
	// A folder of the temporary form is nobody's temporary; a link is not
	// followed.
	os.Mkdir(filepath.Join(b.Root(), "job/steps/1/.d.tmp-0000000000000000"), 0o750)
	os.Symlink("/etc/passwd", filepath.Join(b.Root(), "job/steps/1/a/.rank-00002.data.tmp-0000000000000001"))

	list := func(prefix string) map[string]storage.Temporary {
		got := map[string]storage.Temporary{}
		err := b.ListTemporaries(ctx, prefix, func(tmp storage.Temporary) error {
			got[tmp.Name] = tmp
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	got := list("job/")
	if len(got) != 2 {
		t.Fatalf("ListTemporaries(job/) = %+v, want the two leftovers", got)
	}
	one, two := got["job/steps/1/a/rank-00001.data"], got["job/steps/2/b/rank-00000.data"]
	if one.ID != ".rank-00001.data.tmp-0123456789abcdef" || one.Size != 5000 || time.Since(one.ModTime) > time.Hour {
		t.Errorf("fresh leftover = %+v", one)
	}
	if two.Size != 7 || !two.ModTime.Equal(old.Truncate(time.Second)) && two.ModTime.Sub(old).Abs() > time.Second {
		t.Errorf("old leftover = %+v, want 7 bytes last written at %v", two, old)
	}
	if g := list("job/steps/1/a/rank-00001"); len(g) != 1 {
		t.Errorf("ListTemporaries by the object's prefix = %+v", g)
	}
	if g := list("job/steps/1/a/.rank"); len(g) != 0 {
		t.Errorf("ListTemporaries by the temporary file's own prefix = %+v, want none (prefixes are of object names)", g)
	}
	var names []string
	_ = b.List(ctx, "", func(oi storage.ObjectInfo) error { names = append(names, oi.Name); return nil })
	if !slices.Equal(names, []string{"job/steps/1/a/rank-00000.data"}) {
		t.Errorf("List = %q, want the one object", names)
	}
	for _, bad := range []storage.Temporary{
		{Name: "job/steps/2/b/rank-00000.data", ID: ".rank-00001.data.tmp-fedcba9876543210"}, // another object's
		{Name: "job/steps/2/b/rank-00000.data", ID: "rank-00000.data"},                       // the object itself
		{Name: "job/steps/2/b/rank-00000.data", ID: "../a/.rank-00000.data.tmp-fedcba9876543210"},
	} {
		if err := b.DeleteTemporary(ctx, bad); !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("DeleteTemporary(%+v) = %v, want ErrInvalidName", bad, err)
		}
	}
	link := storage.Temporary{Name: "job/steps/1/a/rank-00002.data", ID: ".rank-00002.data.tmp-0000000000000001"}
	if err := b.DeleteTemporary(ctx, link); !errors.Is(err, storage.ErrSymlink) {
		t.Errorf("DeleteTemporary of a link = %v, want ErrSymlink", err)
	}
	os.Remove(filepath.Join(b.Root(), "job/steps/1/a/.rank-00002.data.tmp-0000000000000001"))
	for range 2 {
		if err := b.DeleteTemporary(ctx, two); err != nil {
			t.Fatalf("DeleteTemporary: %v", err)
		}
	}
	if _, err := os.Stat(filepath.Join(b.Root(), "job/steps/2")); !os.IsNotExist(err) {
		t.Errorf("the folders the leftover was alone in are still there: %v", err)
	}
	if err := b.DeleteTemporary(ctx, one); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Stat(ctx, "job/steps/1/a/rank-00000.data"); err != nil {
		t.Errorf("the object beside the leftover: %v", err)
	}
	if g := list(""); len(g) != 0 {
		t.Errorf("left: %+v", g)
	}
	os.Remove(filepath.Join(b.Root(), "job/steps/1/.d.tmp-0000000000000000"))
}
