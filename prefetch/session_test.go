package prefetch

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
)

// A session reads ahead from the moment it opens: its ring is full before
// anyone asks for a batch, and the first batch comes with the ring full.
func TestSessionReadsAheadFromOpen(t *testing.T) {
	s := newService(t, posixDataset(t, 3, 10, 1000), ServiceConfig{Slots: 4, SlotBytes: 1 << 20})
	ctx := context.Background()
	id := openPairs(t, s)
	ss, _ := s.session(Owner{}, id)
	waitFor(t, "4 batches in the ring, none asked for", func() bool { return len(ss.filled) == 4 })
	if n := s.cache.StorageReads(); n == 0 {
		t.Fatal("no shard read before the first request")
	}
	if _, _, _, err := s.Next(ctx, Owner{}, id, nil); err != nil {
		t.Fatal(err)
	}
	if n := len(ss.filled); n != 3 {
		t.Fatalf("%d batches queued behind the first; want the ring's other 3", n)
	}
}

// openPairs opens a session of batches of 2, unshuffled.
func openPairs(t *testing.T, s *Service) string {
	t.Helper()
	id, _, err := s.OpenSession(context.Background(), Owner{}, src, Spec{BatchSize: 2, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// gatedBackend lets reads of the shard first in order through and holds
// the others until open is closed.
type gatedBackend struct {
	storage.Backend
	first Shard
	open  chan struct{}
}

// gatedDataset is a dataset of 3 shards of 4 samples behind a gate.
func gatedDataset(t *testing.T) gatedBackend {
	t.Helper()
	b := posixDataset(t, 3, 4, 1000)
	all, err := ListShards(context.Background(), b, "", WebDataset, DefaultListBytes)
	if err != nil {
		t.Fatal(err)
	}
	return gatedBackend{b, ShardsForRank(all, 0, 0, 0, 1)[0], make(chan struct{})}
}

func (g gatedBackend) Get(ctx context.Context, name string, off, n int64) (io.ReadCloser, error) {
	if name != g.first.Name {
		select {
		case <-g.open:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.Backend.Get(ctx, name, off, n)
}

// The first batch waits for the ring to fill only so long: with storage
// stalled after one shard, it comes after primeWait, not never.
func TestFirstBatchWaitsForTheRingBoundedly(t *testing.T) {
	ctx := context.Background()
	gate := gatedDataset(t)
	s := newService(t, gate, ServiceConfig{Slots: 4, SlotBytes: 1 << 20})
	opened := time.Now()
	id := openPairs(t, s)
	tctx, cancel := context.WithTimeout(ctx, testtime.Scale(30*time.Second))
	defer cancel()
	_, lease, _, err := s.Next(tctx, Owner{}, id, nil)
	if err != nil {
		t.Fatalf("first batch with storage stalled after one shard: %v", err)
	}
	if took := time.Since(opened); took < minPrimeWait {
		t.Fatalf("first batch after %v with the ring half full; want it to wait %v for the ring", took, minPrimeWait)
	}
	close(gate.open)
	n, release := 1, []string{lease}
	for {
		var d *Delivery
		d, lease, _, err = s.Next(ctx, Owner{}, id, release)
		if errors.Is(err, io.EOF) {
			if d != nil {
				t.Fatal("a batch with the end of the epoch")
			}
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		n, release = n+1, []string{lease}
	}
	if n != 6 {
		t.Fatalf("%d batches; want 6", n)
	}
}

// An epoch whose first shard is cached hands out its first batch at once,
// without waiting for the ring to fill (nothing from the cache is late):
// with the primeWait timer stopped and storage stalled after the first
// shard, only a start that does not wait hands out a batch at all.
func TestCachedStartDoesNotWaitForTheRing(t *testing.T) {
	ctx := context.Background()
	gate := gatedDataset(t)
	defer close(gate.open)
	s := newService(t, gate, ServiceConfig{Slots: 4, SlotBytes: 1 << 20, CacheBytes: 64 << 20})
	if _, held, _, err := s.cache.get(ctx, gate.Backend, "", gate.first, readAt{}, func() {}); err != nil || !held {
		t.Fatalf("caching the first shard: held %v, %v", held, err)
	}
	s.primeTimer = func(time.Duration, func()) *time.Timer { return time.NewTimer(time.Hour) }
	id := openPairs(t, s)
	tctx, cancel := context.WithTimeout(ctx, testtime.Scale(30*time.Second))
	defer cancel()
	if _, _, _, err := s.Next(tctx, Owner{}, id, nil); err != nil {
		t.Fatalf("first batch from the cache, the ring unfilled and no prime timer: %v", err)
	}
}

// orderedGate lets reads of the first n shards of an order through, n
// raised by the test.
type orderedGate struct {
	storage.Backend
	order map[string]int
	n     *atomic.Int32
}

func newOrderedGate(t *testing.T, b storage.Backend) orderedGate {
	all, err := ListShards(context.Background(), b, "", WebDataset, DefaultListBytes)
	if err != nil {
		t.Fatal(err)
	}
	g := orderedGate{b, map[string]int{}, new(atomic.Int32)}
	for i, sh := range ShardsForRank(all, 0, 0, 0, 1) {
		g.order[sh.Name] = i
	}
	return g
}

func (g orderedGate) Get(ctx context.Context, name string, off, n int64) (io.ReadCloser, error) {
	for g.order[name] >= int(g.n.Load()) {
		select {
		case <-time.After(time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return g.Backend.Get(ctx, name, off, n)
}

// A trainer that catches up with a ring that had been full (it was
// slower than storage, then faster) gets a slot more, up to MaxSlots; a
// ring never grows into the room a new session's ring needs.
func TestRingGrowsWhenTheTrainerCatchesUp(t *testing.T) {
	ctx := context.Background()
	gate := newOrderedGate(t, posixDataset(t, 12, 4, 1000))
	// Room for two starting rings of 2 and one slot more: the first ring
	// may grow by one slot only.
	s := newService(t, gate, ServiceConfig{Slots: 2, MaxSlots: 4, SlotBytes: 1 << 20, ArenaBytes: 5 << 20})
	id := openPairs(t, s)
	ss, _ := s.session(Owner{}, id)
	var release []string
	take := func(n int) { // n batches, each as soon as it is ready
		t.Helper()
		for range n {
			_, lease, _, err := s.Next(ctx, Owner{}, id, release)
			if err != nil {
				t.Fatal(err)
			}
			release = []string{lease}
		}
	}
	for round, want := range []int{3, 3} {
		gate.n.Add(2) // a shard: 2 batches, the ring's 2 slots; another for the filler to wait on the ring with
		waitFor(t, "the filler to wait on a full ring", func() bool { return ss.state.Load() == int32(CauseRing) })
		take(4) // the trainer takes all 4, then finds the ring empty
		// next() judges at its start whether the trainer caught up: let the
		// filler get back to waiting on storage for the gated shard first.
		waitFor(t, "the filler to wait on storage", ss.behind)
		done := make(chan error, 1)
		go func() {
			_, lease, _, err := s.Next(ctx, Owner{}, id, release)
			release = []string{lease}
			done <- err
		}()
		// It asks for a slot more (or, on a slow machine, already did while
		// it took the four: it caught up with the filler for a moment).
		waitFor(t, "the trainer to ask for a batch not ready", func() bool { return ss.grow.Load() || ss.ring.Slots() == want })
		gate.n.Add(1)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if got := ss.ring.Slots(); got != want {
			t.Fatalf("round %d: ring of %d slots; want %d", round, got, want)
		}
		take(1)
	}
	if _, _, err := s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 2, WorldSize: 1}); err != nil {
		t.Fatalf("a second session beside a grown ring: %v", err)
	}
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	testtime.Until(t, 30*time.Second, what, ok)
}
