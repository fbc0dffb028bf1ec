package prefetch

import (
	"context"
	"slices"
	"strings"
	"testing"
)

// sameShardNeighbours is the fraction of adjacent samples of keys
// ("<shard>/<i>") that come from one shard: about 1/k for samples mixed
// from k shards, near 1 for a window smaller than a shard.
func sameShardNeighbours(keys []string) float64 {
	same := 0
	for i := 1; i < len(keys); i++ {
		a, _, _ := strings.Cut(keys[i-1], "/")
		b, _, _ := strings.Cut(keys[i], "/")
		if a == b {
			same++
		}
	}
	return float64(same) / float64(len(keys)-1)
}

// A block shuffle (Spec.ShuffleBlock) delivers every sample once across
// the ranks, as a function of (seed, epoch, rank); resumes at a start as
// the tail of the same order, and at another world size from the
// delivered sets; and mixes shards where a window smaller than a shard
// does not: with shards of 200 samples, a window of 100 gives neighbours
// from the same shard most of the time, blocks of 4 shards about a
// quarter of it.
func TestShuffleBlock(t *testing.T) {
	b := dataset(t, 16, 200, 10)
	c := newCache(t, 64<<20)
	spec := Spec{BatchSize: 8, WorldSize: 2, Seed: 3, Epoch: 1, ShuffleBlock: 4, Even: EvenOff}
	var all []string
	var orders [2][]string
	for rank := range 2 {
		spec.Rank = rank
		orders[rank], _ = keys(t, b, c, spec)
		again, _ := keys(t, b, c, spec)
		if !slices.Equal(orders[rank], again) {
			t.Fatalf("rank %d: the same spec gave another order", rank)
		}
		all = append(all, orders[rank]...)
	}
	slices.Sort(all)
	if len(all) != 16*200 || len(slices.Compact(all)) != 16*200 {
		t.Fatalf("%d samples delivered, %d distinct; want 3,200 once each", len(all), len(slices.Compact(all)))
	}
	spec.Rank = 0
	for _, k := range []int64{1, 333, 800, 1600} {
		spec.Start = k
		if tail, _ := keys(t, b, c, spec); !slices.Equal(tail, orders[0][k:]) {
			t.Fatalf("resume at %d is not the tail of the order", k)
		}
	}
	spec.Start = 0

	block := sameShardNeighbours(orders[0])
	window, _ := keys(t, b, c, Spec{BatchSize: 8, WorldSize: 2, Seed: 3, Epoch: 1, ShuffleWindow: 100, Even: EvenOff})
	win := sameShardNeighbours(window)
	t.Logf("neighbours from one shard: window of 100 %.2f, blocks of 4 shards %.2f", win, block)
	if win < 0.5 || block > 0.35 {
		t.Fatalf("neighbours from one shard: window %.2f, block %.2f; want the window's above 0.5 and the block's under 0.35", win, block)
	}

	// Elastic: half of each rank's order read at 2 ranks, the rest at 3.
	union := NewDelivered()
	seen := map[string]int{}
	for rank := range 2 {
		spec.Rank = rank
		it, err := Open(context.Background(), b, "train/", c, spec, Options{})
		if err != nil {
			t.Fatal(err)
		}
		got, d := consume(t, it, 50)
		it.Close()
		for _, k := range got {
			seen[k]++
		}
		union.Union(d)
	}
	for rank := range 3 {
		it, err := Open(context.Background(), b, "train/", c,
			Spec{BatchSize: 8, WorldSize: 3, Rank: rank, Seed: 3, Epoch: 1, ShuffleBlock: 4, Even: EvenOff, Delivered: union}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		got, _ := consume(t, it, -1)
		it.Close()
		for _, k := range got {
			seen[k]++
		}
	}
	if len(seen) != 3200 {
		t.Fatalf("elastic: %d distinct samples, want 3,200", len(seen))
	}
	for k, n := range seen {
		if n != 1 {
			t.Fatalf("elastic: sample %s delivered %d times", k, n)
		}
	}
}

// A block of more shards than the spec allows is refused.
func TestShuffleBlockBounds(t *testing.T) {
	for _, n := range []int{-1, MaxShuffleBlock + 1} {
		s := Spec{BatchSize: 1, WorldSize: 1, ShuffleBlock: n}
		if err := s.Validate(); err == nil {
			t.Fatalf("shuffle block %d accepted", n)
		}
	}
}
