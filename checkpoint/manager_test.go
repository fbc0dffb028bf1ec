package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/internal/arena"
)

// shmArena is the daemon's shared-memory arena as the Manager sees it, as
// internal/server.CheckpointArena fits it for ckptd serve (which these
// tests cannot import: it imports this package).
type shmArena struct{ *arena.Arena }

func (a shmArena) Alloc(ctx context.Context, n int64) (Region, error) {
	r, err := a.Arena.Alloc(ctx, n)
	return Region(r), err
}

func (a shmArena) Free(r Region) error    { return a.Arena.Free(arena.Region(r)) }
func (a shmArena) Reserve(r Region) error { return a.Arena.Reserve(arena.Region(r)) }
func (a shmArena) Journal() Journal       { return shmJournal{a.Arena.Journal()} }

type shmJournal struct{ *arena.Journal }

func (j shmJournal) List() ([]JournalEntry, error) {
	entries, err := j.Journal.List()
	out := make([]JournalEntry, len(entries))
	for i, e := range entries {
		out[i] = JournalEntry(e)
	}
	return out, err
}

func newManager(t *testing.T, cfg ManagerConfig) *Manager {
	t.Helper()
	b, _ := newBackend(t)
	dir := fmt.Sprintf("/dev/shm/ckptd-mgr-test-%d-%s", os.Getpid(), t.Name())
	t.Cleanup(func() { os.RemoveAll(dir) })
	a, err := arena.Open(arena.Options{Dir: dir, Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	cfg.DefaultJob = "job"
	mgr, err := NewManager(shmArena{a}, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mgr.Close(context.Background()) })
	return mgr
}

func u8(name string, off, n int64) Tensor {
	return Tensor{Name: name, DType: dtype.U8, Shape: []int64{n}, Offset: off, Length: n}
}

func target(step int64) Target { return Target{Step: step, WorldSize: 1, Attempt: "a"} }

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("%s: not within 5s", what)
}

// A client that goes away between BeginSave and CommitSave frees its
// region at once, and the same rank can be saved again.
func TestOwnerGoneReleases(t *testing.T) {
	mgr := newManager(t, ManagerConfig{})
	done := make(chan struct{})
	o := Owner{ID: "conn-1", Done: done}
	if _, err := mgr.BeginSave(context.Background(), o, target(1), []Tensor{u8("w", 0, 1<<20)}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := mgr.BeginRestore(context.Background(), o, "", 1, false, 0); !errors.Is(err, ErrStepNotFound) {
		t.Fatalf("restore of nothing: %v", err)
	}
	if mgr.arena.Used() == 0 {
		t.Fatal("no region held")
	}
	// Another connection cannot touch the lease.
	other := Owner{ID: "conn-2", Done: make(chan struct{})}
	if _, err := mgr.BeginSave(context.Background(), other, target(1), []Tensor{u8("w", 0, 1)}); !errors.Is(err, ErrExists) {
		t.Fatalf("second save of the rank while the first stages: %v", err)
	}
	close(done)
	eventually(t, "region freed after the owner left", func() bool { return mgr.arena.Used() == 0 })
	info, err := mgr.BeginSave(context.Background(), other, target(1), []Tensor{u8("w", 0, 1)})
	if err != nil {
		t.Fatalf("re-save after the dead client's lease was released: %v", err)
	}
	if _, _, err := mgr.CommitSave(o, info.ID, nil); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("commit of another connection's lease: %v", err)
	}
	if err := mgr.AbortSave(Owner{}, info.ID); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("abort of another connection's lease: %v", err)
	}
	if _, _, err := mgr.CommitSave(other, info.ID, nil); err != nil {
		t.Fatal(err)
	}
	// A lease granted to an owner already gone is dropped at once.
	if _, err := mgr.BeginSave(context.Background(), o, target(2), []Tensor{u8("w", 0, 1)}); !errors.Is(err, context.Canceled) {
		t.Fatalf("save for a gone owner: %v", err)
	}
}

// An expired lease of a live client stops working at once but keeps its
// region until the client goes: it may still be copying into it.
func TestExpiredLeaseFenced(t *testing.T) {
	mgr := newManager(t, ManagerConfig{LeaseTimeout: 50 * time.Millisecond})
	done := make(chan struct{})
	o := Owner{ID: "slow", Done: done}
	info, err := mgr.BeginSave(context.Background(), o, target(1), []Tensor{u8("w", 0, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "lease expired", func() bool {
		mgr.mu.Lock()
		defer mgr.mu.Unlock()
		return mgr.leases.byID[info.ID] == nil
	})
	if _, _, err := mgr.CommitSave(o, info.ID, nil); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("commit of an expired lease: %v", err)
	}
	if mgr.arena.Used() == 0 {
		t.Fatal("the region of a live writer was handed back")
	}
	close(done)
	eventually(t, "region freed once the writer left", func() bool { return mgr.arena.Used() == 0 })
}

// Open tensor tables are bounded: a save whose table would exceed the
// budget fails, and the budget comes back when saves end.
func TestTableBudget(t *testing.T) {
	mgr := newManager(t, ManagerConfig{TableBudget: 64 << 10})
	table := func(n int) []Tensor {
		ts := make([]Tensor, n)
		for i := range ts {
			ts[i] = u8(fmt.Sprintf("t%05d", i), int64(i), 1)
		}
		return ts
	}
	o := Owner{ID: "c", Done: make(chan struct{})}
	first, err := mgr.BeginSave(context.Background(), o, target(1), table(150))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mgr.BeginSave(context.Background(), o, target(2), table(150)); !errors.Is(err, ErrOverBudget) {
		t.Fatalf("second big table: %v", err)
	}
	if err := mgr.AbortSave(o, first.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := mgr.BeginSave(context.Background(), o, target(2), table(150)); err != nil {
		t.Fatalf("after the first was aborted: %v", err)
	}
}

// On a crashed daemon's arena (kept for its journal), new regions wait out
// the fence: the dead daemon's clients may still be copying.
func TestCrashFence(t *testing.T) {
	b, _ := newBackend(t)
	dir := fmt.Sprintf("/dev/shm/ckptd-mgr-test-%d-%s", os.Getpid(), t.Name())
	t.Cleanup(func() { os.RemoveAll(dir) })
	a, err := arena.Open(arena.Options{Dir: dir, Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Journal().Put("junk", []byte("{}")); err != nil { // something staged, so the file is kept
		t.Fatal(err)
	}
	a.Close()
	if a, err = arena.Open(arena.Options{Dir: dir, Size: 8 << 20}); err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mgr, err := NewManager(shmArena{a}, b, ManagerConfig{DefaultJob: "job", ReuseFence: 300 * time.Millisecond, StagingWait: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer mgr.Close(context.Background())
	start := time.Now()
	if _, err := mgr.BeginSave(context.Background(), Owner{}, target(1), []Tensor{u8("w", 0, 1)}); err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited < 250*time.Millisecond {
		t.Fatalf("a save on a crashed daemon's arena got a region after %s, inside the fence", waited)
	}
}

// A save journaled by a daemon older than attempts (its entry names none)
// was acknowledged: an upgraded daemon drains and commits it under
// LegacyAttempt rather than setting it aside.
func TestLegacyJournalEntryDrains(t *testing.T) {
	b, _ := newBackend(t)
	dir := fmt.Sprintf("/dev/shm/ckptd-mgr-test-%d-%s", os.Getpid(), t.Name())
	t.Cleanup(func() { os.RemoveAll(dir) })
	a, err := arena.Open(arena.Options{Dir: dir, Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	layout, err := NewLayout([]Tensor{u8("w", 0, 5000)})
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.Alloc(context.Background(), layout.RegionSize)
	if err != nil {
		t.Fatal(err)
	}
	for i := range int64(5000) {
		a.Bytes()[r.Offset+i] = byte(i % 251)
	}
	// The format of the journal before attempts: no "Attempt" key.
	entry := fmt.Sprintf(`{"lease":"old","offset":%d,"length":%d,`+
		`"target":{"Job":"job","Step":7,"Rank":0,"WorldSize":1},`+
		`"tensors":[{"name":"w","dtype":"U8","shape":[5000],"offset":0,"length":5000}],`+
		`"metadata":null,"staged_at":"2026-11-01T00:00:00Z"}`, r.Offset, r.Length)
	if err := a.Journal().Put("old", []byte(entry)); err != nil {
		t.Fatal(err)
	}
	a.Close()
	if a, err = arena.Open(arena.Options{Dir: dir, Size: 8 << 20}); err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mgr, err := NewManager(shmArena{a}, b, ManagerConfig{DefaultJob: "job", ReuseFence: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer mgr.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := mgr.Wait(ctx, "job", 7, 0, LegacyAttempt); err != nil {
		t.Fatalf("the legacy save did not become durable: %v", err)
	}
	s := &Store{B: b, Job: "job"}
	rec, err := s.Resolve(ctx, 7, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Attempt != LegacyAttempt {
		t.Fatalf("committed attempt %q, want %q", rec.Attempt, LegacyAttempt)
	}
	m, err := s.Manifest(ctx, rec, 0)
	if err != nil {
		t.Fatal(err)
	}
	if m.DataSize != 5000 {
		t.Fatalf("data size %d", m.DataSize)
	}
	if _, err := s.Verify(ctx, 7, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
}
