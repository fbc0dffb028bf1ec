package posix_test

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// OpenBeneath opens regular files below the root and refuses a link
// anywhere on the way, naming it, and anything but a regular file, with
// openat2 and with the walk that stands in for it.
func TestOpenBeneath(t *testing.T) {
	resolvers(t, func(t *testing.T, opts posix.Options) {
		root, out := t.TempDir(), t.TempDir()
		for p, data := range map[string]string{"ds/a/x.tar": "inside", "ds/b/y.tar": "inside"} {
			writeFile(t, filepath.Join(root, p), data)
		}
		writeFile(t, filepath.Join(out, "x.tar"), "outside")
		must(t, os.Symlink(filepath.Join(out, "x.tar"), filepath.Join(root, "ds/a/link.tar")))
		must(t, os.Symlink(out, filepath.Join(root, "ds/c")))
		must(t, os.Symlink("y.tar", filepath.Join(root, "ds/b/rel.tar"))) // a link even to a neighbour
		must(t, unix.Mkfifo(filepath.Join(root, "ds/a/fifo.tar"), 0o644))
		b := open(t, root, opts)

		f, err := b.OpenBeneath("ds/a/x.tar")
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(f)
		f.Close()
		if err != nil || string(data) != "inside" {
			t.Fatalf("a regular file: %q, %v", data, err)
		}
		for name, want := range map[string]struct {
			err error
			msg string
		}{
			"ds/a/link.tar": {storage.ErrSymlink, `"ds/a/link.tar" is a symbolic link`},
			"ds/b/rel.tar":  {storage.ErrSymlink, `"ds/b/rel.tar" is a symbolic link`},
			"ds/c/x.tar":    {storage.ErrSymlink, `"ds/c" is a symbolic link`},
			"ds/a/fifo.tar": {posix.ErrNotRegular, "named pipe"},
			"ds/a":          {posix.ErrNotRegular, "not a regular file"},
			"ds/a/none.tar": {fs.ErrNotExist, "none.tar"},
			"ds/none/x.tar": {fs.ErrNotExist, "ds/none"},
			"ds/a/../x.tar": {storage.ErrInvalidName, ".."},
			"/etc/passwd":   {storage.ErrInvalidName, "passwd"},
		} {
			f, err := openWithin(t, b, name)
			if err == nil {
				f.Close()
			}
			if !errors.Is(err, want.err) || !strings.Contains(err.Error(), want.msg) {
				t.Errorf("OpenBeneath(%q): %v; want %v naming %q", name, err, want.err, want.msg)
			}
		}
	})
}

// openWithin opens name, failing the test if the open blocks (a FIFO with
// no writer); a minute is far beyond an open on a loaded machine.
func openWithin(t *testing.T, b *posix.Backend, name string) (*os.File, error) {
	t.Helper()
	type result struct {
		f   *os.File
		err error
	}
	done := make(chan result, 1)
	go func() { f, err := b.OpenBeneath(name); done <- result{f, err} }()
	select {
	case r := <-done:
		return r.f, r.err
	case <-time.After(time.Minute):
		t.Fatalf("OpenBeneath(%q) blocked", name)
		return nil, nil
	}
}

func writeFile(t *testing.T, p, data string) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(p), 0o755))
	must(t, os.WriteFile(p, []byte(data), 0o644))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
