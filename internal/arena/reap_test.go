package arena

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
)

func TestReapStale(t *testing.T) {
	parent := t.TempDir()
	names := regexp.MustCompile(`^ckptd-\d+$`)
	open := func(name string) *Arena {
		t.Helper()
		log, _ := testLogger()
		a, err := Open(Options{Dir: filepath.Join(parent, name), Size: mib, Owner: "/run/" + name + ".sock", Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	live := open("ckptd-1") // its daemon runs
	t.Cleanup(func() { live.Close() })
	open("ckptd-2").Close() // its daemon died with nothing staged
	staged := open("ckptd-3")
	if err := staged.Journal().Put("save1", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	staged.Close()                                                            // its daemon died with a save staged
	open("ckptd-other").Close()                                               // not a default arena's name
	open("ckptd-4").Close()                                                   // the caller's own
	if err := os.Mkdir(filepath.Join(parent, "ckptd-5"), 0o700); err != nil { // no lock: being made
		t.Fatal(err)
	}
	exists := func(name string) bool {
		_, err := os.Stat(filepath.Join(parent, name))
		return err == nil
	}
	opts := ReapOptions{Parent: parent, Names: names, Skip: filepath.Join(parent, "ckptd-4"), DryRun: true}

	got, err := ReapStale(opts)
	if err != nil || len(got) != 2 || got[0].Dir != filepath.Join(parent, "ckptd-2") || got[1].Journaled != 1 ||
		got[0].Removed || got[1].Removed || !exists("ckptd-2") {
		t.Fatalf("dry run = %+v, %v; want ckptd-2 and ckptd-3 (one staged save), nothing removed", got, err)
	}
	if got[0].Socket != "/run/ckptd-2.sock" || got[0].Bytes < mib {
		t.Errorf("dry run names %+v, want its socket and at least the arena's MiB", got[0])
	}

	opts.DryRun = false
	got, err = ReapStale(opts)
	if err != nil || len(got) != 2 || !got[0].Removed || got[1].Removed {
		t.Fatalf("ReapStale = %+v, %v; want ckptd-2 removed, ckptd-3 kept", got, err)
	}
	var left []string
	for _, name := range []string{"ckptd-1", "ckptd-2", "ckptd-3", "ckptd-other", "ckptd-4", "ckptd-5"} {
		if exists(name) {
			left = append(left, name)
		}
	}
	if want := []string{"ckptd-1", "ckptd-3", "ckptd-other", "ckptd-4", "ckptd-5"}; !slices.Equal(left, want) {
		t.Fatalf("left %v, want %v", left, want)
	}
	reopened := open("ckptd-3") // the kept arena still opens, its save journaled
	if n := reopened.Journal().Len(); n != 1 {
		t.Errorf("the kept arena's journal holds %d entries, want 1", n)
	}
	reopened.Close()

	opts.Force = true
	got, err = ReapStale(opts)
	if err != nil || len(got) != 1 || !got[0].Removed || exists("ckptd-3") || !exists("ckptd-1") {
		t.Fatalf("forced ReapStale = %+v, %v; want ckptd-3 removed, the live ckptd-1 kept", got, err)
	}
	log, _ := testLogger()
	a, err := Open(Options{Dir: filepath.Join(parent, "ckptd-3"), Size: mib, Logger: log})
	if err != nil {
		t.Fatalf("a daemon starts on a reaped folder's place: %v", err)
	}
	a.Close()
}
