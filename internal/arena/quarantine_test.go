package arena

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// An entry quarantined is gone from the journal for good, even after a
// restart, and its reason sits next to it in journal/quarantine/.
func TestQuarantine(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "journal")
	j, _, err := openJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"bad", "good"} {
		if err := j.Put(id, []byte("data of "+id)); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Quarantine("bad", "replay crashed: layout overflows the region\n"); err != nil {
		t.Fatal(err)
	}
	if got := ids(mustList(t, j)); !slices.Equal(got, []string{"good"}) || j.Len() != 1 || j.Quarantined() != 1 {
		t.Fatalf("after Quarantine: List %v, Len %d, Quarantined %d", got, j.Len(), j.Quarantined())
	}
	files, _ := filepath.Glob(filepath.Join(dir, "quarantine", "*-bad*"))
	if len(files) != 2 {
		t.Fatalf("quarantine holds %v, want the entry and its reason", files)
	}
	data, _ := os.ReadFile(files[0])
	reason, _ := os.ReadFile(files[1])
	if string(data) != "data of bad" || string(reason) != "replay crashed: layout overflows the region\n" {
		t.Fatalf("quarantined %q with reason %q", data, reason)
	}

	j2, _, err := openJournal(dir) // a restart
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(mustList(t, j2)); !slices.Equal(got, []string{"good"}) || j2.Quarantined() != 1 {
		t.Fatalf("after a restart: List %v, Quarantined %d", got, j2.Quarantined())
	}
	// The same id may be journaled and quarantined again.
	if err := j2.Put("bad", []byte("again")); err != nil {
		t.Fatal(err)
	}
	if err := j2.Quarantine("bad", "again"); err != nil || j2.Quarantined() != 2 {
		t.Fatalf("second quarantine of one id: %v, Quarantined %d", err, j2.Quarantined())
	}
}

func TestQuarantineRejects(t *testing.T) {
	j := newJournal(t)
	if err := j.Quarantine("missing", "x"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Quarantine of a missing entry = %v", err)
	}
	for _, id := range []string{"../x", "", ".tmp-1", "quarantine"} {
		if err := j.Quarantine(id, "x"); !errors.Is(err, ErrInvalidID) {
			t.Errorf("Quarantine(%q) = %v, want ErrInvalidID", id, err)
		}
	}
	if err := j.Put("quarantine", nil); !errors.Is(err, ErrInvalidID) {
		t.Errorf("Put of the quarantine folder's name = %v", err)
	}
	if j.Quarantined() != 0 {
		t.Errorf("Quarantined() = %d", j.Quarantined())
	}
	j.Put("x", nil)
	j.close()
	if err := j.Quarantine("x", "r"); !errors.Is(err, ErrClosed) {
		t.Errorf("Quarantine after close = %v", err)
	}
}

// The quarantine keeps the newest 64 entries.
func TestQuarantineIsBounded(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "journal")
	j, _, err := openJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	const n = maxQuarantined + 6
	for i := range n {
		id := fmt.Sprintf("e%03d", i)
		if err := j.Put(id, nil); err != nil {
			t.Fatal(err)
		}
		if err := j.Quarantine(id, "bad"); err != nil {
			t.Fatal(err)
		}
	}
	if j.Quarantined() != maxQuarantined || j.Len() != 0 {
		t.Fatalf("Quarantined %d Len %d, want %d and 0", j.Quarantined(), j.Len(), maxQuarantined)
	}
	des, _ := os.ReadDir(filepath.Join(dir, "quarantine"))
	if len(des) != 2*maxQuarantined {
		t.Fatalf("quarantine folder holds %d files, want %d", len(des), 2*maxQuarantined)
	}
	for _, de := range des {
		var i int
		if _, err := fmt.Sscanf(de.Name()[strings.LastIndex(de.Name(), "-")+1:], "e%03d", &i); err != nil || i < n-maxQuarantined {
			t.Errorf("kept %s: not among the newest", de.Name())
		}
	}
}

// The crash loop this is for: an entry that cannot be replayed no longer
// keeps the arena from being removed once it is quarantined.
func TestQuarantineLetsTheArenaGo(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "arena")
	a := mustOpen(t, Options{Dir: dir, Size: mib})
	a.Journal().Put("poison", []byte("{"))
	if err := a.Remove(); !errors.Is(err, ErrJournalNotEmpty) {
		t.Fatalf("Remove = %v", err)
	}
	if err := a.Journal().Quarantine("poison", "does not parse"); err != nil {
		t.Fatal(err)
	}
	if err := a.Remove(); err != nil {
		t.Fatal(err)
	}
}
