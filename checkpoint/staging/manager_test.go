package staging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/testreap"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
	"github.com/ckptd/ckptd/storage/posix"
)

// shmArena is the daemon's shared-memory arena as the Manager sees it, as
// internal/server.CheckpointArena fits it for ckptd serve (which these
// tests cannot import: it imports this package).
type shmArena struct{ *arena.Arena }

func (a shmArena) Alloc(ctx context.Context, n int64) (Region, error) {
	return a.alloc(a.Arena.Alloc(ctx, n))
}

func (a shmArena) AllocWriter(ctx context.Context, n int64) (Region, error) {
	return a.alloc(a.Arena.AllocWriter(ctx, n))
}

func (a shmArena) Seal(r Region) { a.Arena.Seal(arena.Region(r)) }

func (a shmArena) alloc(r arena.Region, err error) (Region, error) {
	switch { // as CheckpointArena does: the arena's errors match the Manager's
	case errors.Is(err, arena.ErrFull):
		err = errors.Join(err, ErrArenaFull)
	case errors.Is(err, arena.ErrTooLarge):
		err = errors.Join(err, ErrArenaTooLarge)
	}
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
	mgr, _ := newManagerOn(t, b, cfg)
	return mgr
}

// newBackend is a POSIX store in a temporary folder, and that folder.
func newBackend(t *testing.T) (storage.Backend, string) {
	t.Helper()
	dir := t.TempDir()
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, dir
}

// A test arena left by a test binary that died is removed by the reaper.
func TestMain(m *testing.M) { os.Exit(testreap.Run(m)) }

// arenaSeq makes each test arena's folder unique.
var arenaSeq atomic.Int64

// newManagerOn starts a Manager on b with an arena of its own, which it
// returns too, for tests that write a save's bytes.
func newManagerOn(t *testing.T, b storage.Backend, cfg ManagerConfig) (*Manager, *arena.Arena) {
	t.Helper()
	dir := fmt.Sprintf("%smgr-%s-%d", testreap.Prefix, strings.ReplaceAll(t.Name(), "/", "_"), arenaSeq.Add(1))
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
	return mgr, a
}

// arenaBytes is the part of an arena a test writes into and reads from.
type arenaBytes interface{ Bytes() []byte }

// saveBytes saves data as one U8 tensor of tg through mgr, as a client
// would: lease, copy into the arena, commit.
func saveBytes(t *testing.T, mgr *Manager, a *arena.Arena, tg checkpoint.Target, data []byte) {
	t.Helper()
	saveBytesTo(t, mgr, a, tg, data)
}

func saveBytesTo(t *testing.T, mgr *Manager, a arenaBytes, tg checkpoint.Target, data []byte) {
	t.Helper()
	info, err := mgr.BeginSave(context.Background(), Owner{}, tg, []checkpoint.Tensor{u8("w", 0, int64(len(data)))})
	if err != nil {
		t.Fatal(err)
	}
	copy(a.Bytes()[info.Offset:], data)
	if _, _, err := mgr.CommitSave(Owner{}, info.ID, nil, nil); err != nil {
		t.Fatal(err)
	}
}

// settled waits for the save of tg to be committed, failed or kept in memory, asking only
// for its status: nobody calls Wait, which would try the commit itself.
func settled(t *testing.T, mgr *Manager, tg checkpoint.Target) WaitResult {
	t.Helper()
	var res WaitResult
	eventually(t, "the save settles", func() bool {
		var err error
		res, err = mgr.Status(context.Background(), tg.Job, tg.Step, tg.Rank, tg.Attempt)
		return err == nil && (res.final || res.State == StateCommitted || res.State == StateFailed)
	})
	return res
}

func u8(name string, off, n int64) checkpoint.Tensor {
	return checkpoint.Tensor{Name: name, DType: dtype.U8, Shape: []int64{n}, Offset: off, Length: n}
}

func target(step int64) checkpoint.Target {
	return checkpoint.Target{Step: step, WorldSize: 1, Attempt: "a"}
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testtime.Until(t, 30*time.Second, what, cond)
}

// A client that goes away between BeginSave and CommitSave frees its
// region at once, and the same rank can be saved again.
func TestOwnerGoneReleases(t *testing.T) {
	mgr := newManager(t, ManagerConfig{})
	done := make(chan struct{})
	o := Owner{ID: "conn-1", Done: done}
	if _, err := mgr.BeginSave(context.Background(), o, target(1), []checkpoint.Tensor{u8("w", 0, 1<<20)}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := mgr.BeginRestore(context.Background(), o, RestoreRequest{Step: 1}); !errors.Is(err, checkpoint.ErrStepNotFound) {
		t.Fatalf("restore of nothing: %v", err)
	}
	if mgr.arena.Used() == 0 {
		t.Fatal("no region held")
	}
	// Another connection cannot touch the lease.
	other := Owner{ID: "conn-2", Done: make(chan struct{})}
	if _, err := mgr.BeginSave(context.Background(), other, target(1), []checkpoint.Tensor{u8("w", 0, 1)}); !errors.Is(err, checkpoint.ErrExists) {
		t.Fatalf("second save of the rank while the first stages: %v", err)
	}
	close(done)
	eventually(t, "region freed after the owner left", func() bool { return mgr.arena.Used() == 0 })
	info, err := mgr.BeginSave(context.Background(), other, target(1), []checkpoint.Tensor{u8("w", 0, 1)})
	if err != nil {
		t.Fatalf("re-save after the dead client's lease was released: %v", err)
	}
	if _, _, err := mgr.CommitSave(o, info.ID, nil, nil); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("commit of another connection's lease: %v", err)
	}
	if err := mgr.AbortSave(Owner{}, info.ID); !errors.Is(err, ErrUnknownLease) {
		t.Fatalf("abort of another connection's lease: %v", err)
	}
	if _, _, err := mgr.CommitSave(other, info.ID, nil, nil); err != nil {
		t.Fatal(err)
	}
	// A lease granted to an owner already gone is dropped at once.
	if _, err := mgr.BeginSave(context.Background(), o, target(2), []checkpoint.Tensor{u8("w", 0, 1)}); !errors.Is(err, context.Canceled) {
		t.Fatalf("save for a gone owner: %v", err)
	}
}

// An expired lease of a live client stops working at once but keeps its
// region until the client goes: it may still be copying into it.
func TestExpiredLeaseFenced(t *testing.T) {
	mgr := newManager(t, ManagerConfig{LeaseTimeout: 50 * time.Millisecond})
	done := make(chan struct{})
	o := Owner{ID: "slow", Done: done}
	info, err := mgr.BeginSave(context.Background(), o, target(1), []checkpoint.Tensor{u8("w", 0, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "lease expired", func() bool {
		mgr.mu.Lock()
		defer mgr.mu.Unlock()
		return mgr.leases.byID[info.ID] == nil
	})
	if _, _, err := mgr.CommitSave(o, info.ID, nil, nil); !errors.Is(err, ErrUnknownLease) {
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
	table := func(n int) []checkpoint.Tensor {
		ts := make([]checkpoint.Tensor, n)
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
	layout, err := checkpoint.NewLayout([]checkpoint.Tensor{u8("w", 0, 5000)})
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
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(30*time.Second))
	defer cancel()
	if _, err := mgr.Wait(ctx, "job", 7, 0, checkpoint.LegacyAttempt); err != nil {
		t.Fatalf("the legacy save did not become durable: %v", err)
	}
	s, err := checkpoint.NewStore(b, "job")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Resolve(ctx, 7, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Attempt != checkpoint.LegacyAttempt {
		t.Fatalf("committed attempt %q, want %q", rec.Attempt, checkpoint.LegacyAttempt)
	}
	m, err := s.Manifest(ctx, rec, 0)
	if err != nil {
		t.Fatal(err)
	}
	if m.DataSize != 5000 {
		t.Fatalf("data size %d", m.DataSize)
	}
	if _, err := s.Verify(ctx, 7, false, checkpoint.ReadOptions{}); err != nil {
		t.Fatal(err)
	}
}

// The last rank's commit fails once: its drain retries the commit with
// backoff (nobody else would ever commit the step), and keeps the save
// journaled until the commit is settled.
func TestCommitRetriedWithoutWaiters(t *testing.T) {
	b := faulty.New(memstore.New())
	fail := b.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpPutIfAbsent, Name: "job/steps/*/COMMIT.json", Times: 1})
	mgr, a := newManagerOn(t, b, ManagerConfig{})
	tg := checkpoint.Target{Job: "job", Step: 3, WorldSize: 1, Attempt: "a"}
	saveBytes(t, mgr, a, tg, []byte("weights"))
	if res := settled(t, mgr, tg); res.State != StateCommitted {
		t.Fatalf("state %s (%v), want committed", res.State, res.Err)
	}
	if fail.Hits() != 1 {
		t.Fatalf("the commit failed %d times, want once", fail.Hits())
	}
	eventually(t, "the journal entry goes once the commit is settled", func() bool {
		es, err := a.Journal().List()
		return err == nil && len(es) == 0
	})
}

// A save whose step has a damaged commit record fails as corrupt rather
// than retrying forever.
func TestDamagedCommitFailsSave(t *testing.T) {
	b := memstore.New()
	if err := b.Put(context.Background(), "job/steps/000000000004/COMMIT.json", strings.NewReader("{not json"), 9); err != nil {
		t.Fatal(err)
	}
	mgr, a := newManagerOn(t, b, ManagerConfig{})
	tg := checkpoint.Target{Job: "job", Step: 4, WorldSize: 1, Attempt: "a"}
	saveBytes(t, mgr, a, tg, []byte("weights"))
	if res := settled(t, mgr, tg); res.State != StateFailed || !errors.Is(res.Err, checkpoint.ErrCorrupt) {
		t.Fatalf("state %s (%v), want failed as corrupt", res.State, res.Err)
	}
}

// A second run that reuses an attempt id and saves other bytes for a rank
// the first run stored is refused; the first run's bytes stay.
func TestReusedAttemptRefused(t *testing.T) {
	b := memstore.New()
	mgr, a := newManagerOn(t, b, ManagerConfig{})
	r0 := checkpoint.Target{Job: "job", Step: 5, Rank: 0, WorldSize: 2, Attempt: "a"}
	saveBytes(t, mgr, a, r0, []byte("first run"))
	eventually(t, "rank 0 durable", func() bool {
		res, err := mgr.Status(context.Background(), "job", 5, 0, "a")
		return err == nil && res.State == StateDurable
	})
	mgr.Close(context.Background())
	a.Close()

	mgr2, a2 := newManagerOn(t, b, ManagerConfig{})
	saveBytes(t, mgr2, a2, r0, []byte("other run"))
	if res := settled(t, mgr2, r0); res.State != StateFailed || !errors.Is(res.Err, checkpoint.ErrInvalid) {
		t.Fatalf("state %s (%v), want failed as invalid", res.State, res.Err)
	}
}

// A client whose connection ends while its process lives (stopped, cut
// off by keepalive) may resume copying: its save region is reused only
// once the process has ended. Its lease ends at once all the same.
func TestStoppedClientKeepsRegion(t *testing.T) {
	mgr := newManager(t, ManagerConfig{})
	var mu sync.Mutex
	alive := true
	done := make(chan struct{})
	o := Owner{ID: "stopped", Done: done, Exited: func() (bool, bool) {
		mu.Lock()
		defer mu.Unlock()
		return !alive, true
	}}
	info, err := mgr.BeginSave(context.Background(), o, target(1), []checkpoint.Tensor{u8("w", 0, 1<<20)})
	if err != nil {
		t.Fatal(err)
	}
	close(done)
	eventually(t, "the lease ends with the connection", func() bool {
		mgr.mu.Lock()
		defer mgr.mu.Unlock()
		return mgr.leases.lookup(info.ID, o) == nil
	})
	time.Sleep(1500 * time.Millisecond) // a reaper tick or more
	if mgr.arena.Used() == 0 {
		t.Fatal("the region of a live process was freed when its connection ended")
	}
	mu.Lock()
	alive = false
	mu.Unlock()
	eventually(t, "the region is freed once the process has ended", func() bool { return mgr.arena.Used() == 0 })
}

// Restores beyond ManagerConfig.Restores wait their turn (their memory is
// bounded by the count), and give up with their context.
func TestRestoresBounded(t *testing.T) {
	b := faulty.New(memstore.New())
	mgr, a := newManagerOn(t, b, ManagerConfig{Restores: 1})
	tg := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
	saveBytes(t, mgr, a, tg, []byte("weights"))
	if res := settled(t, mgr, tg); res.State != StateCommitted {
		t.Fatalf("state %s (%v)", res.State, res.Err)
	}
	slow := b.Inject(faulty.Fault{Kind: faulty.Delay, Ops: faulty.OpGet, Name: "job/steps/*/a/rank-*.data", Delay: time.Second})
	first := make(chan error, 1)
	go func() {
		_, _, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1})
		first <- err
	}()
	eventually(t, "the first restore reads", func() bool { return slow.Hits() > 0 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, _, err := mgr.BeginRestore(ctx, Owner{}, RestoreRequest{Job: "job", Step: 1}); !errors.Is(err, context.DeadlineExceeded) || !slices.Contains(budget.Of(err), budget.Restores) {
		t.Fatalf("a second restore while the only slot is taken: %v", err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if _, _, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1}); err != nil {
		t.Fatalf("a restore after the first ended: %v", err)
	}
}

// ckptd_arena_used_bytes reads the arena when collected, so space a
// dataset ring takes (from the arena, not through the Manager) shows at
// once.
func TestArenaGaugeFollowsTheArena(t *testing.T) {
	b, _ := newBackend(t)
	mgr, a := newManagerOn(t, b, ManagerConfig{})
	r, err := a.Alloc(context.Background(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(mgr.m.ArenaUsed); got != float64(a.Used()) || got < 1<<20 {
		t.Fatalf("gauge %v with %d bytes of the arena used", got, a.Used())
	}
	if err := a.Free(r); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(mgr.m.ArenaUsed); got != 0 {
		t.Fatalf("gauge %v with the arena empty", got)
	}
}

// During a storage outage a save that finds the arena full of saves the
// drains cannot write is refused ARENA_FULL naming the outage, not just
// its own deadline; once storage is back the next save goes through.
func TestArenaFullNamesTheOutage(t *testing.T) {
	b := faulty.New(memstore.New())
	outage := b.Outage(faulty.OpAll)
	mgr, a := newManagerOn(t, b, ManagerConfig{StagingWait: 200 * time.Millisecond})
	t.Cleanup(outage.Remove) // before the Manager closes, which waits for its drains
	held := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
	saveBytesTo(t, mgr, a, held, make([]byte, 6<<20)) // most of the 8 MiB arena
	eventually(t, "the drain retries", func() bool { res, _, _ := mgr.saves.status(&saveKey{"job", 1, 0, "a"}); return res.Err != nil })
	_, err := mgr.BeginSave(context.Background(), Owner{}, checkpoint.Target{Job: "job", Step: 2, WorldSize: 1, Attempt: "a"},
		[]checkpoint.Tensor{u8("w", 0, 4<<20)})
	if !errors.Is(err, ErrArenaFull) || !strings.Contains(err.Error(), "storage does not answer") {
		t.Fatalf("a save into an arena full of drains stuck on storage: %v", err)
	}
	outage.Remove()
	if res := settled(t, mgr, held); res.State != StateCommitted {
		t.Fatalf("the held save after the outage: %s (%v)", res.State, res.Err)
	}
	if mgr.stalled.Load() != nil {
		t.Fatal("the outage is still remembered after a drain succeeded")
	}
}

// While storage does not take bytes, saves that the arena cannot hold
// move queued saves to the spill folder instead of failing; a crash with
// saves spilled loses none, and once storage is back every save drains,
// the spilled first, byte for byte.
func TestSpillDuringOutage(t *testing.T) {
	pb, _ := newBackend(t)
	b := faulty.New(pb)
	spillDir := t.TempDir()
	cfg := ManagerConfig{SpillDir: spillDir, StagingWait: testtime.Scale(time.Minute)}
	mgr, a := newManagerOn(t, b, cfg)
	outage := b.Outage(faulty.OpAll)
	want := map[int64][]byte{}
	for step := int64(1); step <= 8; step++ { // 16 MiB through an 8 MiB arena
		data := bytes.Repeat([]byte{byte(step)}, 2<<20)
		want[step] = data
		saveBytes(t, mgr, a, target(step), data)
	}
	spilled := func() int { // saves' files, not the folder's lock
		des, _ := os.ReadDir(spillDir)
		n := 0
		for _, de := range des {
			if de.Name() != spillLock {
				n++
			}
		}
		return n
	}
	if spilled() == 0 || testutil.ToFloat64(mgr.m.Spilled) == 0 {
		t.Fatalf("8 saves of 2 MiB through an 8 MiB arena with storage away: nothing spilled (%d files)", spilled())
	}

	// A crash: the next Manager finds the arena's saves and the spilled ones.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second) // the drains retry for as long as the daemon runs
	defer cancel()
	if n := mgr.Close(ctx); n != 8 {
		t.Fatalf("closing with storage away left %d saves journaled or spilled, want 8", n)
	}
	outage.Remove()
	a.Close()
	a2, err := arena.Open(arena.Options{Dir: a.Path()[:len(a.Path())-len("/arena")], Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a2.Close() })
	cfg.DefaultJob = "job"
	mgr2, err := NewManager(shmArena{a2}, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mgr2.Close(context.Background()) })
	for step, data := range want {
		if res := settled(t, mgr2, target(step)); res.State != StateCommitted {
			t.Fatalf("step %d after the outage: %v (%v)", step, res.State, res.Err)
		}
		lease, h, err := mgr2.BeginRestore(context.Background(), Owner{}, RestoreRequest{Step: step})
		if err != nil {
			t.Fatal(err)
		}
		if got := a2.Bytes()[lease.Offset : lease.Offset+h.Size]; !bytes.Equal(got, data) {
			t.Fatalf("step %d restored other bytes", step)
		}
		_ = mgr2.Release(Owner{}, lease.ID)
	}
	eventually(t, "the spill folder to empty", func() bool { return spilled() == 0 })
}
