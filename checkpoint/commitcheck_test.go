package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/counted"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
)

// tinyShard is a rank's shard of a few bytes, for steps of many ranks.
func tinyShard(attempt string, step int64, rank, world int) *Shard {
	data := []byte{byte(rank), byte(rank >> 8), byte(step), 1}
	l, err := NewLayout([]Tensor{{Name: "w", DType: dtype.U8, Shape: []int64{4}, Length: 4}})
	if err != nil {
		panic(err)
	}
	return &Shard{Target: Target{Job: "job", Step: step, Rank: rank, WorldSize: world, Attempt: attempt}, Layout: l, Data: data}
}

func countedStore(t *testing.T) (*counted.Backend, *Store, *Writer) {
	t.Helper()
	c := counted.New(memstore.New(), nil)
	w, err := NewWriter(c, WriterOptions{ChunkSize: 64 << 10, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	return c, &Store{backend: c, job: "job"}, w
}

// calls returns the calls of op made since before.
func callsSince(c *counted.Backend, before map[string]int64, op string) int64 {
	return c.Calls()[op] - before[op]
}

// Ranks written one at a time, in any order, each followed by its drain's
// check: only the last one commits, each check lists one group of 100
// ranks, and only the checks that complete a group list more. Every
// manifest is read once: by the rank that commits, or in a step of more
// than 100 ranks by the rank that completes its group, which writes the
// group's summary; the rank that commits then reads the summaries.
func TestTryCommitRankClimbsGroups(t *testing.T) {
	for _, world := range []int{1, 7, 100, 101, 250, 1203} {
		c, s, w := countedStore(t)
		ctx := context.Background()
		order := rand.Perm(world)
		var lists, gets int64
		for i, rank := range order {
			sh := tinyShard(testAttempt, 3, rank, world)
			if _, err := w.WriteShard(ctx, sh); err != nil {
				t.Fatal(err)
			}
			before := c.Calls()
			rec, won, err := s.TryCommitRank(ctx, sh.Target)
			lists += callsSince(c, before, counted.OpList)
			gets += callsSince(c, before, counted.OpGet)
			last := i == world-1
			if err != nil || (rec != nil) != last || won != last {
				t.Fatalf("world %d: check after rank %d (%d of %d written) = %v, %v, %v", world, rank, i+1, world, rec, won, err)
			}
		}
		// One listing per rank, and one of the summaries per group of 100
		// completed.
		groups := (world + 99) / 100
		if world <= 100 {
			groups = 0
		}
		if lists != int64(world+groups) {
			t.Errorf("world %d: %d listings, want %d", world, lists, world+groups)
		}
		// Every manifest, every summary, and the commit record looked for first.
		if gets != int64(world+groups)+1 {
			t.Errorf("world %d: %d reads, want %d", world, gets, world+groups+1)
		}
		rec, err := s.Resolve(ctx, 3, false)
		if err != nil || rec.WorldSize != world || rec.Attempt != testAttempt {
			t.Fatalf("world %d: committed %+v, %v", world, rec, err)
		}
		for rank := range world {
			if _, err := s.Manifest(ctx, rec, rank); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A step of more than 100 ranks commits from its groups' summaries: one
// that does not match the group's manifests' step, attempt or ranks stops
// the commit (corrupt, nothing written), and a group whose completing rank
// died before writing its summary leaves the step to the waiters'
// fallback, which reads every manifest.
func TestCommitByGroupsGuards(t *testing.T) {
	const world = 150
	ctx := context.Background()
	write := func(w *Writer, step int64, skip int) *Shard {
		var last *Shard
		for rank := range world {
			if rank == skip {
				continue
			}
			last = tinyShard(testAttempt, step, rank, world)
			if _, err := w.WriteShard(ctx, last); err != nil {
				t.Fatal(err)
			}
		}
		return last
	}
	t.Run("forged summary", func(t *testing.T) {
		c, s, w := countedStore(t)
		forged, _ := json.Marshal(groupSummary{Format: GroupFormat, Version: GroupVersion, Job: "job", Step: 9, Attempt: testAttempt,
			WorldSize: world, FirstRank: 0, Manifests: []ManifestRef{{Object: Target{Step: 9, Attempt: testAttempt, Rank: 0}.manifestObject(), Hash: "xxh3:0123456789abcdef"}}})
		if err := c.PutIfAbsent(ctx, inJob("job", groupObject(9, testAttempt, 0)), forged); err != nil {
			t.Fatal(err)
		}
		last := write(w, 9, -1)
		rec, _, err := s.TryCommitRank(ctx, last.Target)
		if !errors.Is(err, ErrCorrupt) || rec != nil {
			t.Fatalf("commit over a forged summary: %+v, %v; want corrupt", rec, err)
		}
		if _, err := s.ReadCommit(ctx, 9); !errors.Is(err, storage.ErrNotFound) {
			t.Fatalf("a commit record was written: %v", err)
		}
	})
	t.Run("completer lost", func(t *testing.T) {
		shortFallback(t, 50*time.Millisecond)
		_, s, w := countedStore(t)
		for rank := range world { // rank 99, which completes group 0, never checks
			sh := tinyShard(testAttempt, 10, rank, world)
			if _, err := w.WriteShard(ctx, sh); err != nil {
				t.Fatal(err)
			}
			if rank == 99 {
				continue
			}
			if rec, _, err := s.TryCommitRank(ctx, sh.Target); err != nil || rec != nil {
				t.Fatalf("rank %d's check: %+v, %v", rank, rec, err)
			}
		}
		waiter := tinyShard(testAttempt, 10, 0, world).Target
		deadline := time.Now().Add(time.Minute)
		for {
			rec, _, err := s.PollCommit(ctx, waiter)
			if err != nil {
				t.Fatal(err)
			}
			if rec != nil {
				if rec.WorldSize != world || len(rec.Manifests) != world {
					t.Fatalf("committed %+v", rec)
				}
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("no waiter committed the step")
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
}

// Ranks written at once, each checking after its write: the step commits
// exactly once, with every rank.
func TestTryCommitRankConcurrent(t *testing.T) {
	const world = 230
	_, s, w := countedStore(t)
	var wins, seen atomic.Int32
	var wg sync.WaitGroup
	for rank := range world {
		wg.Go(func() {
			sh := tinyShard(testAttempt, 4, rank, world)
			if _, err := w.WriteShard(t.Context(), sh); err != nil {
				t.Error(err)
				return
			}
			rec, won, err := s.TryCommitRank(t.Context(), sh.Target)
			if err != nil {
				t.Error(err)
			}
			if rec != nil {
				seen.Add(1)
			}
			if won {
				wins.Add(1)
			}
		})
	}
	wg.Wait()
	if wins.Load() != 1 || seen.Load() < 1 {
		t.Fatalf("%d checks committed, %d saw the commit; want 1 and at least 1", wins.Load(), seen.Load())
	}
	if rec, err := s.Resolve(t.Context(), 4, false); err != nil || rec.WorldSize != world {
		t.Fatalf("committed %+v, %v", rec, err)
	}
}

// A rank completing a step another attempt committed gets that attempt's
// record, and commits nothing.
func TestTryCommitRankOtherAttemptCommitted(t *testing.T) {
	_, s, w := countedStore(t)
	ctx := context.Background()
	for _, attempt := range []string{"first", "second"} {
		for rank := range 2 {
			if _, err := w.WriteShard(ctx, tinyShard(attempt, 5, rank, 2)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if rec, won, err := s.TryCommitRank(ctx, tinyShard("first", 5, 1, 2).Target); err != nil || !won || rec.Attempt != "first" {
		t.Fatalf("first attempt: %+v, %v, %v", rec, won, err)
	}
	rec, won, err := s.TryCommitRank(ctx, tinyShard("second", 5, 0, 2).Target)
	if err != nil || won || rec == nil || rec.Attempt != "first" {
		t.Fatalf("second attempt: %+v, %v, %v; want the first's record", rec, won, err)
	}
}

// An attempt whose ranks were saved with two world sizes never commits.
func TestTryCommitRankMixedWorldSizes(t *testing.T) {
	_, s, w := countedStore(t)
	ctx := context.Background()
	for _, sh := range []*Shard{tinyShard(testAttempt, 6, 0, 2), tinyShard(testAttempt, 6, 1, 3)} {
		if _, err := w.WriteShard(ctx, sh); err != nil {
			t.Fatal(err)
		}
	}
	sh := tinyShard(testAttempt, 6, 1, 2)
	if rec, _, err := s.TryCommitRank(ctx, sh.Target); !errors.Is(err, ErrInvalid) || rec != nil {
		t.Fatalf("mixed world sizes: %+v, %v; want invalid", rec, err)
	}
}

// shortFallback makes PollCommit check for a stuck step at once, and
// again 10ms after each check, and commit one found whole for grace.
func shortFallback(t *testing.T, grace time.Duration) {
	start, spread, g := fallbackStart, fallbackSpread, fallbackGrace
	fallbackStart = func(int) time.Duration { return 0 }
	fallbackSpread = func(int) time.Duration { return 10 * time.Millisecond }
	fallbackGrace = func(int) time.Duration { return grace }
	t.Cleanup(func() { fallbackStart, fallbackSpread, fallbackGrace = start, spread, g })
}

// The waiters of a step share their looks at its commit record: many
// looks within pollShare read it once.
func TestPollCommitShared(t *testing.T) {
	c, s, w := countedStore(t)
	ctx := context.Background()
	sh := tinyShard(testAttempt, 7, 0, 2)
	if _, err := w.WriteShard(ctx, sh); err != nil {
		t.Fatal(err)
	}
	before := c.Calls()
	start := time.Now()
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			if rec, won, err := s.PollCommit(ctx, sh.Target); rec != nil || won || err != nil {
				t.Errorf("look at an uncommitted step: %+v, %v, %v", rec, won, err)
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	reads, lists := callsSince(c, before, counted.OpGet), callsSince(c, before, counted.OpList)
	if took < pollShare(2) && (reads != 1 || lists != 0) {
		t.Fatalf("50 looks within %v read %d times and listed %d times; want one read", took, reads, lists)
	}
	// Rank 1's drain commits: the waiters know at once, reading nothing.
	sh1 := tinyShard(testAttempt, 7, 1, 2)
	if _, err := w.WriteShard(ctx, sh1); err != nil {
		t.Fatal(err)
	}
	if rec, won, err := s.TryCommitRank(ctx, sh1.Target); rec == nil || !won || err != nil {
		t.Fatalf("commit: %+v, %v, %v", rec, won, err)
	}
	before = c.Calls()
	rec, _, err := s.PollCommit(ctx, sh.Target)
	if err != nil || rec == nil || rec.Attempt != testAttempt {
		t.Fatalf("look after the commit: %+v, %v", rec, err)
	}
	if n := callsSince(c, before, counted.OpGet); n != 0 {
		t.Errorf("the look after this process's commit read %d objects", n)
	}
}

// A step whose ranks are all written but that nobody committed (the last
// rank's node was lost after writing it) is committed by a waiter, once
// it has been found whole for the grace; before, a waiter only looks.
func TestPollCommitFallback(t *testing.T) {
	const grace = 300 * time.Millisecond
	shortFallback(t, grace)
	c, s, w := countedStore(t)
	ctx := context.Background()
	for rank := range 3 {
		if _, err := w.WriteShard(ctx, tinyShard(testAttempt, 8, rank, 3)); err != nil {
			t.Fatal(err)
		}
	}
	waiter := tinyShard(testAttempt, 8, 0, 3).Target
	start := time.Now()
	deadline := start.Add(time.Minute)
	for {
		before := c.Calls()
		rec, won, err := s.PollCommit(ctx, waiter)
		if err != nil {
			t.Fatal(err)
		}
		if rec != nil {
			if rec.WorldSize != 3 || rec.Attempt != testAttempt || !won {
				t.Fatalf("committed %+v (won %v)", rec, won)
			}
			if time.Since(start) < grace {
				t.Fatalf("committed after %v, before the grace of %v", time.Since(start), grace)
			}
			return
		}
		if n := callsSince(c, before, counted.OpPutIfAbsent); n != 0 {
			t.Fatal("a look that found no record wrote one")
		}
		if time.Now().After(deadline) {
			t.Fatal("no waiter committed the whole step")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A slow commit (its last rank's drain reading every manifest through
// throttling) is not raced by waiters before the grace.
func TestPollCommitGraceHoldsOff(t *testing.T) {
	shortFallback(t, time.Hour)
	c, s, w := countedStore(t)
	ctx := context.Background()
	for rank := range 3 {
		if _, err := w.WriteShard(ctx, tinyShard(testAttempt, 11, rank, 3)); err != nil {
			t.Fatal(err)
		}
	}
	before := c.Calls()
	for range 20 {
		if rec, _, err := s.PollCommit(ctx, tinyShard(testAttempt, 11, 1, 3).Target); rec != nil || err != nil {
			t.Fatalf("look: %+v, %v", rec, err)
		}
		time.Sleep(15 * time.Millisecond)
	}
	if n := callsSince(c, before, counted.OpList); n == 0 {
		t.Error("the waiters never checked whether the step was stuck")
	}
	if n := callsSince(c, before, counted.OpGet); n > 20 {
		t.Errorf("the waiters read %d objects; a check must not read the manifests before the grace", n)
	}
}

// The drains of a node's ranks share one read of a step's commit record,
// and know a commit this process made without reading it.
func TestReadCommitShared(t *testing.T) {
	c, s, w := countedStore(t)
	ctx := context.Background()
	before := c.Calls()
	start := time.Now()
	var wg sync.WaitGroup
	for rank := range 20 {
		wg.Go(func() {
			if rec, err := s.ReadCommitShared(ctx, tinyShard(testAttempt, 12, rank, 20).Target); rec != nil || !errors.Is(err, storage.ErrNotFound) {
				t.Errorf("read of an uncommitted step: %+v, %v", rec, err)
			}
		})
	}
	wg.Wait()
	if n := callsSince(c, before, counted.OpGet); time.Since(start) < pollShare(20) && n != 1 {
		t.Fatalf("20 reads within %v read storage %d times; want once", time.Since(start), n)
	}
	for rank := range 20 {
		if _, err := w.WriteShard(ctx, tinyShard(testAttempt, 12, rank, 20)); err != nil {
			t.Fatal(err)
		}
	}
	if rec, won, err := s.TryCommit(ctx, 12, testAttempt, 20); rec == nil || !won || err != nil {
		t.Fatalf("commit: %+v, %v, %v", rec, won, err)
	}
	before = c.Calls()
	if rec, err := s.ReadCommitShared(ctx, tinyShard(testAttempt, 12, 3, 20).Target); err != nil || rec == nil || rec.Attempt != testAttempt {
		t.Fatalf("read after the commit: %+v, %v", rec, err)
	}
	if n := callsSince(c, before, counted.OpGet); n != 0 {
		t.Errorf("the read after this process's commit asked storage %d times", n)
	}
}

// A damaged commit record is an error for the waiter (which fails the
// save), not a step to wait for forever.
func TestPollCommitDamaged(t *testing.T) {
	c, s, _ := countedStore(t)
	ctx := context.Background()
	if err := c.PutIfAbsent(ctx, commitName("job", 9), []byte("{not json")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.PollCommit(ctx, tinyShard(testAttempt, 9, 0, 2).Target); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("look at a damaged record: %v", err)
	}
	if _, err := s.ReadCommitShared(ctx, tinyShard(testAttempt, 9, 1, 2).Target); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("shared read of a damaged record: %v", err)
	}
}

// A backend that cannot key the shared table is looked at directly.
func TestPollCommitUnsharedBackend(t *testing.T) {
	b := valueBackend{Backend: memstore.New()}
	w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	s := &Store{backend: b, job: "job"}
	sh := tinyShard(testAttempt, 10, 0, 1)
	if _, err := w.WriteShard(context.Background(), sh); err != nil {
		t.Fatal(err)
	}
	if rec, won, err := s.PollCommit(context.Background(), sh.Target); rec == nil || !won || err != nil {
		t.Fatalf("look: %+v, %v, %v", rec, won, err)
	}
}

// valueBackend is a Backend whose type cannot be compared.
type valueBackend struct {
	*memstore.Backend
	_ []int
}

var _ storage.Backend = valueBackend{}

// A store that fails transiently (throttling past the S3 client's
// retries, an outage) fails the check, which its caller retries (the
// drain with backoff, a waiter at its next look): the step still commits
// once the store answers, and a failed look shares no stale answer.
func TestCommitCheckThroughFailures(t *testing.T) {
	f := faulty.New(memstore.New())
	w, err := NewWriter(f, WriterOptions{ChunkSize: 64 << 10, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	s := &Store{backend: f, job: "job"}
	ctx := context.Background()
	for rank := range 3 {
		if _, err := w.WriteShard(ctx, tinyShard(testAttempt, 13, rank, 3)); err != nil {
			t.Fatal(err)
		}
	}
	last := tinyShard(testAttempt, 13, 2, 3).Target
	lists := f.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpList, Times: 2})
	for range 2 {
		if rec, _, err := s.TryCommitRank(ctx, last); !errors.Is(err, storage.ErrUnavailable) || rec != nil {
			t.Fatalf("check through a failing listing: %+v, %v", rec, err)
		}
	}
	if lists.Hits() != 2 {
		t.Fatalf("the listing failed %d times, want 2", lists.Hits())
	}
	f.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpGet, Name: "job/steps/*/COMMIT.json", Times: 1})
	waiter := tinyShard(testAttempt, 13, 0, 3).Target
	if _, _, err := s.PollCommit(ctx, waiter); !errors.Is(err, storage.ErrUnavailable) {
		t.Fatalf("look through a failing read: %v", err)
	}
	if rec, won, err := s.TryCommitRank(ctx, last); rec == nil || !won || err != nil {
		t.Fatalf("check once the store answers: %+v, %v, %v", rec, won, err)
	}
	if rec, _, err := s.PollCommit(ctx, waiter); rec == nil || err != nil {
		t.Fatalf("look after the commit: %+v, %v", rec, err)
	}
}
