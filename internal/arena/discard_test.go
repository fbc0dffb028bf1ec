package arena

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// listTree returns every path under dir, relative to it ("" for dir itself;
// nil if dir does not exist).
func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		out = append(out, rel)
		return nil
	})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Discard takes back what one Open made, and only that.
func TestDiscard(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		setups := map[string]func(){
			"new dir": func() {},
			"empty dir": func() {
				if err := os.Mkdir(dir, 0o700); err != nil {
					t.Fatal(err)
				}
			},
			"arena left by a daemon": func() {
				a := mustOpen(t, Options{Dir: dir, Size: mib})
				a.Close()
			},
			"staged saves": func() {
				a := mustOpen(t, Options{Dir: dir, Size: mib})
				a.Journal().Put("staged", []byte("{}"))
				a.Close()
			},
		}
		for name, setup := range setups {
			t.Run(name, func(t *testing.T) {
				os.RemoveAll(dir)
				setup()
				before := listTree(t, dir)
				a := mustOpen(t, Options{Dir: dir, Size: 2 * mib})
				if err := a.Discard(); err != nil {
					t.Fatal(err)
				}
				if name == "arena left by a daemon" {
					// With nothing staged, Open replaced the old file by a
					// new one (see openArenaFile), which Discard removes.
					before = slices.DeleteFunc(before, func(p string) bool { return p == "arena" })
				}
				if after := listTree(t, dir); !slices.Equal(before, after) {
					t.Fatalf("before Open: %q; after Discard: %q", before, after)
				}
				if err := a.Discard(); !errors.Is(err, ErrClosed) {
					t.Errorf("second Discard = %v", err)
				}
				b := mustOpen(t, Options{Dir: dir, Size: mib}) // not locked any more
				b.Close()
			})
		}
	})
}

// An Open that fails (here: no room for the arena) leaves nothing behind.
func TestFailedOpenLeavesNothing(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		for _, pre := range []bool{false, true} {
			os.RemoveAll(dir)
			if pre {
				os.Mkdir(dir, 0o700)
			}
			before := listTree(t, dir)
			log, _ := testLogger()
			a, err := Open(Options{Dir: dir, Size: 1 << 50, Logger: log})
			if err == nil {
				a.Close()
				t.Fatal("Open of a 1 PiB arena succeeded")
			}
			if after := listTree(t, dir); !slices.Equal(before, after) {
				t.Fatalf("existing dir %v: before Open %q, after its failure %q (%v)", pre, before, after, err)
			}
		}
	})
}
