package arena

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
)

func markers(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(dir, writersDir))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

// allocWithin allocates n bytes, failing the test unless the arena gives
// them within wait.
func allocWithin(t *testing.T, a *Arena, n int64, wait time.Duration) (Region, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	return a.Alloc(ctx, n)
}

// A client's region is recorded from AllocWriter until Seal or Free.
func TestWritersRecord(t *testing.T) {
	dir := t.TempDir()
	a := mustOpen(t, Options{Dir: dir, Size: 4 * mib})
	r1, err := a.AllocWriter(context.Background(), 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	r2, _ := a.AllocWriter(context.Background(), 128<<10)
	if _, err := a.Alloc(context.Background(), 64<<10); err != nil { // a restore's or a ring's: no record
		t.Fatal(err)
	}
	if got, want := markers(t, dir), []string{markerName(r1), markerName(r2)}; !slices.Equal(got, want) {
		t.Fatalf("records %v, want %v", got, want)
	}
	a.Seal(r1)
	if err := a.Free(r2); err != nil {
		t.Fatal(err)
	}
	if got := markers(t, dir); len(got) != 0 {
		t.Fatalf("records %v after Seal and Free", got)
	}
	if err := a.Free(r1); err != nil { // a sealed region is still allocated until freed
		t.Fatal(err)
	}
}

// After a crash only the regions the dead daemon's clients may still be
// writing wait out the fence; the rest of the arena is free at once, and
// a save journaled just before the crash is recovered into its region.
func TestCrashFenceRegions(t *testing.T) {
	dir := t.TempDir()
	a := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: time.Hour})
	writing, err := a.AllocWriter(context.Background(), 2*mib) // a client copies into it
	if err != nil {
		t.Fatal(err)
	}
	journaled, _ := a.AllocWriter(context.Background(), 2*mib) // journaled, its record not yet dropped
	if err := a.Journal().Put("save-1", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil { // the crash: Close leaves every file, as a kill does
		t.Fatal(err)
	}

	b := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: time.Hour})
	if err := b.Reserve(journaled); err != nil {
		t.Fatalf("recovery of a journaled save whose record was left: %v", err)
	}
	if got := markers(t, dir); !slices.Equal(got, []string{markerName(writing)}) {
		t.Fatalf("records after recovery %v, want only the writing client's", got)
	}
	if _, err := allocWithin(t, b, 4*mib, testtime.Scale(5*time.Second)); err != nil {
		t.Fatalf("the space no client was writing is not free at once: %v", err)
	}
	if _, err := allocWithin(t, b, 64<<10, 50*time.Millisecond); !errors.Is(err, ErrFull) {
		t.Fatalf("the fenced region was handed out: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}

	c := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: 200 * time.Millisecond})
	defer c.Close()
	if err := c.Reserve(journaled); err != nil {
		t.Fatal(err)
	}
	if _, err := allocWithin(t, c, 4*mib, testtime.Scale(5*time.Second)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got, err := allocWithin(t, c, 2*mib, testtime.Scale(time.Minute))
	if err != nil || got != writing {
		t.Fatalf("after the fence the writing client's region is not free: %v, %v", got, err)
	}
	if waited := time.Since(start); waited < 100*time.Millisecond {
		t.Errorf("the fenced region was free after %s, inside the 200ms fence", waited)
	}
	if got := markers(t, dir); len(got) != 0 {
		t.Errorf("records %v after the fence ended", got)
	}
}

// A new arena file drops the record of the old one's writers, and a
// journaled save always gets its region back even where a writer's record
// overlaps it: the journal names acknowledged saves.
func TestWritersRecordOfAnOldFile(t *testing.T) {
	dir := t.TempDir()
	a := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: time.Hour})
	if _, err := a.AllocWriter(context.Background(), 2*mib); err != nil { // a client mid-copy at a stop
		t.Fatal(err)
	}
	a.Close() // nothing journaled: the next start makes a new file
	b := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: time.Hour})
	if got := markers(t, dir); len(got) != 0 {
		t.Fatalf("records %v of the old file's writers survive a new file", got)
	}
	if _, err := b.Alloc(context.Background(), 64<<10); err != nil { // shifts what comes next
		t.Fatal(err)
	}
	saved, err := b.AllocWriter(context.Background(), 3*mib)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Journal().Put("save-1", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	b.Close() // a crash with the save journaled, its record not yet dropped
	// A stray record overlapping the journaled region, as an older daemon could leave.
	stray := Region{Offset: saved.Offset + 1*mib, Length: 2 * mib}
	if err := os.WriteFile(filepath.Join(dir, writersDir, markerName(stray)), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	c := mustOpen(t, Options{Dir: dir, Size: 8 * mib, Fence: time.Hour})
	if err := c.Reserve(saved); err != nil {
		t.Fatalf("the journaled save's region, with a writer's record overlapping it: %v", err)
	}
	if got := markers(t, dir); len(got) != 0 {
		t.Errorf("records %v left after recovery took their regions", got)
	}
}
