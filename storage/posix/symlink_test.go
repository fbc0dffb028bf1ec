package posix_test

import (
	"bytes"
	"errors"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// resolvers runs fn once with openat2 and once with the folder-by-folder
// walk that stands in for it on kernels before 5.6.
func resolvers(t *testing.T, fn func(t *testing.T, opts posix.Options)) {
	t.Run("openat2", func(t *testing.T) {
		b := open(t, t.TempDir(), posix.Options{})
		if !b.UsesOpenat2() {
			t.Skip("this kernel has no openat2")
		}
		fn(t, posix.Options{})
	})
	t.Run("walk", func(t *testing.T) {
		posix.SimulateNoOpenat2(t)
		fn(t, posix.Options{})
	})
}

// snapshot records every file and folder below dir, with its kind and
// contents, so a test can tell that nothing there changed.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		desc := info.Mode().String()
		if d.Type().IsRegular() {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			desc += " " + string(data)
		}
		out[p] = desc
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestSymlinksRefused plants links in the store and checks that every
// operation through them is refused with storage.ErrSymlink, naming the
// object, and that nothing outside the store (nor the link) changes.
func TestSymlinksRefused(t *testing.T) {
	tests := []struct {
		name   string
		link   string // where the link is planted, below the root
		target string // its target; "OUT" stands for the outside folder
		object string // the object name used through it
	}{
		{"step-folder", "job/steps/000000000001", "OUT", "job/steps/000000000001/COMMIT.json"},
		{"object-to-file", "job/steps/000000000001/COMMIT.json", "OUT/victim", "job/steps/000000000001/COMMIT.json"},
		{"object-to-folder", "job/steps/000000000001/rank-00000.data", "OUT", "job/steps/000000000001/rank-00000.data"},
		{"parent-folder", "job", "OUT", "job/steps/000000000001/rank-00000.data"},
		{"top-level-object", "obj", "OUT/victim", "obj"},
		{"inside-the-root", "job/steps/000000000002", "../../other", "job/steps/000000000002/keep"},
		{"dangling", "job/steps/000000000003", "OUT/missing", "job/steps/000000000003/rank-00000.data"},
		{"dangling-object", "job/steps/000000000003/COMMIT.json", "OUT/missing", "job/steps/000000000003/COMMIT.json"},
		{"loop", "job/steps/000000000004", "000000000004", "job/steps/000000000004/COMMIT.json"},
	}
	resolvers(t, func(t *testing.T, opts posix.Options) {
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				root, out := t.TempDir(), t.TempDir()
				if err := os.WriteFile(filepath.Join(out, "victim"), []byte("precious"), 0o644); err != nil {
					t.Fatal(err)
				}
				b := open(t, root, opts)
				if err := b.Put(t.Context(), "other/keep", bytes.NewReader([]byte("k")), 1); err != nil {
					t.Fatal(err)
				}
				plant(t, root, tt.link, strings.Replace(tt.target, "OUT", out, 1))
				before, beforeRoot := snapshot(t, out), snapshot(t, root)
				checkRefused(t, b, tt.object)
				if after := snapshot(t, out); !maps.Equal(before, after) {
					t.Errorf("outside the store changed:\nbefore %v\nafter  %v", before, after)
				}
				if after := snapshot(t, root); !maps.Equal(beforeRoot, after) {
					t.Errorf("the store changed:\nbefore %v\nafter  %v", beforeRoot, after)
				}
				checkListSkipsLinks(t, b, tt.link)
			})
		}
	})
}

func plant(t *testing.T, root, link, target string) {
	t.Helper()
	p := filepath.Join(root, link)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
}

func checkRefused(t *testing.T, b *posix.Backend, name string) {
	t.Helper()
	ctx := t.Context()
	check := func(op string, err error) {
		t.Helper()
		if !errors.Is(err, storage.ErrSymlink) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s(%q) = %v, want ErrSymlink naming the object", op, name, err)
		}
	}
	big := patterned(9 << 20)
	check("Put", b.Put(ctx, name, bytes.NewReader(big), int64(len(big))))
	check("Put-small", b.Put(ctx, name, bytes.NewReader([]byte("x")), 1))
	check("PutIfAbsent", b.PutIfAbsent(ctx, name, []byte(`{"step": 1}`)))
	rc, err := b.Get(ctx, name, 0, -1)
	if err == nil {
		rc.Close()
	}
	check("Get", err)
	_, err = b.Stat(ctx, name)
	check("Stat", err)
	check("Delete", b.Delete(ctx, name))
}

// checkListSkipsLinks: List and ListDirs show the real object only and
// skip the link; listing inside the link is refused.
func checkListSkipsLinks(t *testing.T, b *posix.Backend, link string) {
	t.Helper()
	var names []string
	err := b.List(t.Context(), "", func(info storage.ObjectInfo) error {
		names = append(names, info.Name)
		return nil
	})
	if err != nil || !slices.Equal(names, []string{"other/keep"}) {
		t.Errorf("List(\"\") = %q, %v; want only [other/keep]", names, err)
	}
	var segs []string
	dir, base := path.Split(link)
	err = b.ListDirs(t.Context(), dir, func(seg string) error { segs = append(segs, seg); return nil })
	if err != nil || slices.Contains(segs, base) {
		t.Errorf("ListDirs(%q) = %q, %v; want no %q", dir, segs, err, base)
	}
	err = b.List(t.Context(), link+"/", func(storage.ObjectInfo) error { return nil })
	if !errors.Is(err, storage.ErrSymlink) {
		t.Errorf("List(%q) = %v, want ErrSymlink", link+"/", err)
	}
}

// TestSymlinkAtTempName plants a link where the next temporary file would
// be created: the Put must not write through it.
func TestSymlinkAtTempName(t *testing.T) {
	resolvers(t, func(t *testing.T, opts posix.Options) {
		root, out := t.TempDir(), t.TempDir()
		victim := filepath.Join(out, "victim")
		if err := os.WriteFile(victim, []byte("precious"), 0o644); err != nil {
			t.Fatal(err)
		}
		b := open(t, root, opts)
		next := uint64(0)
		posix.SetTempRandom(t, func() uint64 { next++; return next })
		plant(t, root, "d/.obj.tmp-0000000000000001", victim)
		data := patterned(9 << 20)
		if err := b.Put(t.Context(), "d/obj", bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(readObject(t, b, "d/obj"), data) {
			t.Error("d/obj does not hold what was put")
		}
		if got, err := os.ReadFile(victim); err != nil || string(got) != "precious" {
			t.Errorf("the link's target now holds %q (%v)", got, err)
		}
		if next < 2 {
			t.Errorf("Put made %d temporary names, want a second after the planted one", next)
		}
		os.Remove(filepath.Join(root, "d/.obj.tmp-0000000000000001"))
	})
}

// TestRootMayBeALink: the operator's root may itself be a link; it is
// resolved once, when the backend opens.
func TestRootMayBeALink(t *testing.T) {
	real := t.TempDir()
	link := filepath.Join(t.TempDir(), "store")
	if err := os.Symlink(real, link); err != nil {
		t.Fatal(err)
	}
	b := open(t, link, posix.Options{})
	if err := b.Put(t.Context(), "a/obj", bytes.NewReader([]byte("x")), 1); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(real, "a", "obj")); err != nil || string(got) != "x" {
		t.Fatalf("object not under the link's target: %q, %v", got, err)
	}
	if b.Root() != link {
		t.Errorf("Root() = %q, want the configured %q", b.Root(), link)
	}
}

// TestClosedBackend: after Close, calls fail instead of using a descriptor
// number that may have been reused.
func TestClosedBackend(t *testing.T) {
	b, err := posix.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	if err := b.Put(t.Context(), "a", bytes.NewReader(nil), 0); err == nil {
		t.Error("Put after Close succeeded")
	}
	if _, err := b.Stat(t.Context(), "a"); err == nil || errors.Is(err, storage.ErrNotFound) {
		t.Errorf("Stat after Close = %v, want a failure that is not ErrNotFound", err)
	}
}
