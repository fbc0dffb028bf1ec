package checkpoint

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage"
)

// frozenShard is a fine-tune's shard: a 2 MiB frozen matrix (the same at
// every step) and a 64 KiB trainable one that changes every step.
func frozenShard(step int64, rank, world int) *Shard {
	var ts []Tensor
	var data []byte
	add := func(name string, shape []int64, b []byte) {
		ts = append(ts, Tensor{Name: name, DType: dtype.F32, Shape: shape, Offset: int64(len(data)), Length: int64(len(b))})
		data = append(data, b...)
	}
	add("backbone", []int64{512, 1024}, floats(512*1024, uint64(100+rank)))
	add("adapter", []int64{16, 1024}, floats(16*1024, uint64(step)<<8|uint64(rank)))
	l, err := NewLayout(ts)
	if err != nil {
		panic(err)
	}
	return &Shard{Target: Target{Job: "job", Step: step, Rank: rank, WorldSize: world, Attempt: testAttempt}, Layout: l, Data: data}
}

func incrementalWriter(t *testing.T, b storage.Backend) *Writer {
	t.Helper()
	w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Incremental: true})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// saveFrozen saves and commits every rank of step, and returns the bytes
// each rank's own data object holds.
func saveFrozen(t *testing.T, b storage.Backend, w *Writer, step int64, world int) []*Shard {
	t.Helper()
	ctx := context.Background()
	var shards []*Shard
	for rank := range world {
		sh := frozenShard(step, rank, world)
		m, err := w.WriteShard(ctx, sh)
		if err != nil {
			t.Fatal(err)
		}
		if m.Version != ManifestVersionKeyed || !m.Holds(sh) {
			t.Fatalf("manifest version %d, holds %v", m.Version, m.Holds(sh))
		}
		if owned := slices.ContainsFunc(m.Chunks, func(c Chunk) bool { return !m.Owns(c) }); owned != (step > 1) {
			t.Fatalf("step %d references earlier chunks: %v", step, owned)
		}
		shards = append(shards, sh)
	}
	store, _ := NewStore(b, "job")
	if rec, _, err := store.TryCommit(ctx, step, testAttempt, world); err != nil || rec == nil {
		t.Fatalf("commit step %d: %v, %v", step, rec, err)
	}
	for _, sh := range shards {
		w.Unpin(ctx, sh.Target)
	}
	return shards
}

func dataSize(t *testing.T, b storage.Backend, step int64, rank int) int64 {
	t.Helper()
	oi, err := b.Stat(context.Background(), inJob("job", Target{Step: step, Attempt: testAttempt, Rank: rank}.dataObject()))
	if err != nil {
		t.Fatal(err)
	}
	return oi.Size
}

// A fine-tune's unchanged chunks are referenced, not rewritten; every
// step restores and verifies byte for byte, and after prune keeps only
// the newest, the first step's data stays (the newest references it) and
// the newest still restores.
func TestIncrementalReferencesUnchangedChunks(t *testing.T) {
	ctx := context.Background()
	b, _ := newBackend(t)
	w := incrementalWriter(t, b)
	steps := map[int64][]*Shard{}
	for step := int64(1); step <= 4; step++ {
		steps[step] = saveFrozen(t, b, w, step, 2)
	}
	full := dataSize(t, b, 1, 0)
	for step := int64(2); step <= 4; step++ {
		if got := dataSize(t, b, step, 1); got > full/10 {
			t.Fatalf("step %d wrote %d bytes, the first %d: unchanged chunks were rewritten", step, got, full)
		}
	}
	store, _ := NewStore(b, "job")
	for step, shards := range steps {
		checkStep(t, b, step, shards)
		if _, err := store.Verify(ctx, step, false, ReadOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	rep, err := store.Prune(ctx, PruneOptions{KeepLast: 1})
	if err != nil || !slices.Equal(rep.Removed, []int64{1, 2, 3}) {
		t.Fatalf("prune: %+v, %v", rep, err)
	}
	if dataSize(t, b, 1, 0) != full {
		t.Fatal("prune removed data the kept step references")
	}
	checkStep(t, b, 4, steps[4])
	if _, err := store.Verify(ctx, 4, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Stat(ctx, inJob("job", (Target{Step: 2, Attempt: testAttempt, Rank: 0}).dataObject())); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("step 2's data (referenced by no kept step) is still there: %v", err)
	}
	// A rank the base lacks (the job grew) writes everything.
	sh := frozenShard(5, 2, 3)
	m, err := w.WriteShard(ctx, sh)
	if err != nil || m.Chunks[0].Object != (Target{Step: 5, Attempt: testAttempt, Rank: 2}).dataObject() {
		t.Fatalf("new rank: %v, first chunk in %q", err, m.Chunks[0].Object)
	}
}

// Prune keeps a step an incremental save in flight has pinned, until the
// pin goes or outlives the grace; DeleteStep refuses it.
func TestPinnedBaseKept(t *testing.T) {
	ctx := context.Background()
	b, _ := newBackend(t)
	w := incrementalWriter(t, b)
	for step := int64(1); step <= 3; step++ {
		saveFrozen(t, b, w, step, 1)
	}
	next := frozenShard(4, 0, 1).Target
	base, err := w.dedupBase(ctx, next) // the drain of step 4 has begun
	if err != nil || base == nil || base.step != 3 {
		t.Fatalf("base %+v, %v", base, err)
	}
	store, _ := NewStore(b, "job")
	if _, err := store.DeleteStep(ctx, 3, DeleteOptions{Force: true}); !errors.Is(err, ErrPinned) {
		t.Fatalf("delete of a pinned step: %v, want ErrPinned", err)
	}
	saveFrozen(t, b, incrementalWriter(t, b), 5, 1) // another node's step 5
	rep, err := store.Prune(ctx, PruneOptions{KeepLast: 1})
	if err != nil || !slices.Equal(rep.Kept, []int64{3, 5}) || !slices.Equal(rep.Pinned, []int64{3}) {
		t.Fatalf("prune with step 3 pinned: %+v, %v", rep, err)
	}
	stale, err := store.Prune(ctx, PruneOptions{KeepLast: 1, DryRun: true, Now: time.Now().Add(2 * time.Hour)})
	if err != nil || len(stale.Pinned) != 0 {
		t.Fatalf("a pin older than the grace still counts: %+v, %v", stale, err)
	}
	w.Unpin(ctx, next)
	rep, err = store.Prune(ctx, PruneOptions{KeepLast: 1})
	if err != nil || !slices.Equal(rep.Removed, []int64{3}) {
		t.Fatalf("prune once unpinned: %+v, %v", rep, err)
	}
}

// While a prune runs, or once the base is gone, a save writes every chunk
// and leaves no pin.
func TestNoBaseWhilePruning(t *testing.T) {
	ctx := context.Background()
	b, _ := newBackend(t)
	w := incrementalWriter(t, b)
	saveFrozen(t, b, w, 1, 1)
	store, _ := NewStore(b, "job")
	done, err := store.announcePrune(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := frozenShard(2, 0, 1).Target
	if base, err := w.dedupBase(ctx, next); base != nil || err != nil {
		t.Fatalf("base during a prune: %+v, %v", base, err)
	}
	done()
	pinned, err := store.pinnedSteps(ctx, time.Now().Add(-time.Hour), true)
	if err != nil || len(pinned) != 0 {
		t.Fatalf("pins left: %v, %v", pinned, err)
	}
	// The base loses its commit record between the listing and the pin.
	rec, err := store.ReadCommit(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Delete(ctx, commitName("job", 1)); err != nil {
		t.Fatal(err)
	}
	if base, err := store.readBase(ctx, rec, 0); base != nil || err != nil {
		t.Fatalf("base without its commit record: %+v, %v", base, err)
	}
}

// A prune past its window stops deleting.
func TestPruneWindow(t *testing.T) {
	b, _ := newBackend(t)
	store, _ := NewStore(b, "job")
	p := &pruner{s: store, rep: &PruneReport{}, deadline: time.Now().Add(-time.Second)}
	if err := p.delete(context.Background(), storage.ObjectInfo{Name: "job/x"}); !errors.Is(err, ErrPruneWindow) {
		t.Fatalf("delete past the window: %v", err)
	}
}

// Only a chunk with the same key, length and hash is referenced.
func TestDedupLookup(t *testing.T) {
	c := Chunk{Object: "steps/000000000001/a/rank-00000.data", Raw: 8, Hash: "xxh3:0000000000000001", Key: "xxh3-128:01"}
	base := &dedupBase{chunks: map[string]Chunk{c.Key: c}}
	for _, tc := range []struct {
		name string
		ask  Chunk
		want bool
	}{
		{"same", Chunk{RawOffset: 64, Raw: 8, Hash: c.Hash, Key: c.Key}, true},
		{"other length", Chunk{Raw: 16, Hash: c.Hash, Key: c.Key}, false},
		{"other hash", Chunk{Raw: 8, Hash: "xxh3:0000000000000002", Key: c.Key}, false},
		{"other key", Chunk{Raw: 8, Hash: c.Hash, Key: "xxh3-128:02"}, false},
	} {
		got, ok := base.lookup(tc.ask)
		if ok != tc.want || ok && (got.RawOffset != tc.ask.RawOffset || got.Object != c.Object) {
			t.Errorf("%s: %+v, %v", tc.name, got, ok)
		}
	}
	if _, ok := (*dedupBase)(nil).lookup(c); ok {
		t.Error("no base found a chunk")
	}
}
