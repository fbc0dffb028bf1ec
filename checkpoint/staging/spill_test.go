package staging

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Two daemons on one spill folder would each replay the other's saves.
func TestSpillFolderIsOneDaemons(t *testing.T) {
	dir := t.TempDir()
	s, err := openSpill(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := openSpill(dir, 0); err == nil || !strings.Contains(err.Error(), "another daemon") {
		t.Fatalf("a second open of a spill folder in use: %v", err)
	}
	s.close()
	again, err := openSpill(dir, 0)
	if err != nil {
		t.Fatalf("the folder once its user closed it: %v", err)
	}
	again.close()
}

// Spilled saves go to the head of the drain queue oldest first, however
// they were moved, and ahead of the arena's.
func TestSpilledQueueOrder(t *testing.T) {
	q := drainQueue{wake: make(chan struct{}, 1)}
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	spilled := func(s int) *lease { return &lease{id: "s" + string(rune('0'+s)), begun: at(s), unmap: func() {}} }
	inArena := &lease{id: "a9", begun: at(9), region: Region{Length: 1}}
	q.push(inArena)
	for _, s := range []int{3, 1, 2} {
		q.insertSpilled(spilled(s))
	}
	var got []string
	for l := q.pop(); l != nil; l = q.pop() {
		got = append(got, l.id)
	}
	if strings.Join(got, ",") != "s1,s2,s3,a9" {
		t.Fatalf("drain order %v, want the spilled oldest first, then the arena's", got)
	}
}

// A spill folder is the daemon's own: its saves are replayed as staged
// (copy checks included), so a link or another user's folder is refused,
// and a folder others could write is made 0700.
func TestSpillFolderIsOurs(t *testing.T) {
	dir := t.TempDir()
	wide := filepath.Join(dir, "wide")
	if err := os.Mkdir(wide, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(wide, 0o777); err != nil {
		t.Fatal(err)
	}
	s, err := openSpill(wide, 0)
	if err != nil {
		t.Fatal(err)
	}
	s.lock.Close()
	if fi, _ := os.Stat(wide); fi.Mode().Perm() != 0o700 {
		t.Fatalf("mode %v", fi.Mode())
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(wide, link); err != nil {
		t.Fatal(err)
	}
	if _, err := openSpill(link, 0); err == nil {
		t.Fatal("a link was taken")
	}
	if os.Geteuid() == 0 { // CI: a folder of another user
		theirs := filepath.Join(dir, "theirs")
		if err := os.Mkdir(theirs, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(theirs, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		if _, err := openSpill(theirs, 0); err == nil {
			t.Fatal("another user's folder was taken")
		}
	}
}
