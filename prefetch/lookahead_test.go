package prefetch

import (
	"context"
	"math"
	"testing"
)

// beladyMisses is the fewest misses any cache of capacity shards can have
// on seq (Belady's MIN, knowing the whole future), per epoch of n reads.
func beladyMisses(seq []string, capacity, n int) []int {
	next := make([]int, len(seq)) // the position of the next read of seq[i]
	last := map[string]int{}
	for i := len(seq) - 1; i >= 0; i-- {
		next[i] = math.MaxInt
		if j, ok := last[seq[i]]; ok {
			next[i] = j
		}
		last[seq[i]] = i
	}
	cached := map[string]int{} // key -> its next read
	misses := make([]int, (len(seq)+n-1)/n)
	for i, k := range seq {
		if _, ok := cached[k]; !ok {
			misses[i/n]++
			if len(cached) >= capacity {
				far, farKey := -1, ""
				for ck, nx := range cached {
					if nx > far {
						far, farKey = nx, ck
					}
				}
				if far < next[i] {
					continue // the incoming shard is read last of all: bypass
				}
				delete(cached, farKey)
			}
		}
		cached[k] = next[i]
	}
	return misses
}

// With a dataset larger than the cache, the lookahead (Belady's rule over
// the open iterations' known orders) reads from storage about as little
// as the offline optimum from epoch 1 on. (For one pass per epoch the
// optimum hits what fits, no more: each shard is read once per epoch.
// Keeping what the cache holds achieves that too; the lookahead wins when
// several iterations read the dataset in different orders, below.)
func TestLookaheadNearOptimal(t *testing.T) {
	const shards, epochs = 40, 5
	for _, ratio := range []float64{1.5, 2, 4} {
		b := dataset(t, shards, 4, 10_000)
		size := shardSize(t, b)
		fit := int(float64(shards) / ratio)
		c := newCache(t, int64(fit)*size)
		all, err := ListShards(context.Background(), b, "train/", WebDataset, DefaultListBytes)
		if err != nil {
			t.Fatal(err)
		}
		var seq []string
		got := make([]int64, epochs)
		for epoch := range int64(epochs) {
			for _, sh := range ShardsForRank(all, 0, epoch, 0, 1) {
				seq = append(seq, sh.Name)
			}
			before := c.StorageReads()
			keys(t, b, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: epoch, ShuffleWindow: 1})
			got[epoch] = c.StorageReads() - before
		}
		opt := beladyMisses(seq, fit, shards)
		var ours, best int64
		for e := 1; e < epochs; e++ {
			ours += got[e]
			best += int64(opt[e])
		}
		keep := int64((epochs - 1) * (shards - fit)) // keep-what-you-hold: every epoch misses what does not fit
		t.Logf("dataset %.1fx the cache: storage reads per epoch %v; optimum %v; epochs 1-%d: %d vs optimum %d, keep-what-you-hold %d; hit rate %.0f%% vs %.0f%%",
			ratio, got, opt, epochs-1, ours, best, keep, 100*(1-float64(ours)/float64((epochs-1)*shards)), 100*(1-float64(keep)/float64((epochs-1)*shards)))
		if float64(ours) > 1.05*float64(best)+1 {
			t.Errorf("dataset %.1fx the cache: %d storage reads in epochs 1-%d, optimum %d, keep-what-you-hold %d", ratio, ours, epochs-1, best, keep)
		}
	}
}

// Two iterations read the same dataset at once in different orders (two
// jobs on a node, or training and evaluation): the lookahead keeps a shard
// one has read until the other reads it, and reads much less from storage
// than keeping what the cache holds.
func TestLookaheadSharedDataset(t *testing.T) {
	const shards = 40
	reads := map[bool]int64{}
	for _, ahead := range []bool{false, true} {
		b := dataset(t, shards, 4, 10_000)
		c := newCache(t, shards/2*shardSize(t, b))
		if !ahead {
			c.ahead = nil
		}
		done := make(chan struct{})
		for seed := range uint64(2) {
			go func() {
				defer func() { done <- struct{}{} }()
				for epoch := range int64(3) {
					keys(t, b, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: epoch, Seed: seed, ShuffleWindow: 1})
				}
			}()
		}
		<-done
		<-done
		reads[ahead] = c.StorageReads()
	}
	t.Logf("2 iterations x 3 epochs over %d shards, half fit: storage reads %d with the lookahead, %d keeping what is held (at least %d, at most %d)",
		shards, reads[true], reads[false], shards, 6*shards)
	if reads[true] >= reads[false] {
		t.Errorf("lookahead read %d shards, keep-what-you-hold %d", reads[true], reads[false])
	}
}

// One node of a two-node job reads a different half of the dataset each
// epoch (its rank's shards). Keeping what the cache holds hits only what
// the halves share with the first one; the lookahead knows the rank's
// next epochs and keeps what it will read: strictly fewer storage reads
// once the node's half does not fit, and within 5% of the offline optimum
// (which knows every epoch).
func TestLookaheadOneNodeOfTwo(t *testing.T) {
	const shards, epochs = 40, 5
	for _, ratio := range []float64{1.5, 2, 4} {
		reads := map[bool]int64{}
		fit := int(float64(shards) / ratio)
		var seq []string
		for _, ahead := range []bool{false, true} {
			b := dataset(t, shards, 4, 10_000)
			c := newCache(t, int64(fit)*shardSize(t, b))
			if !ahead {
				c.ahead = nil
			}
			all, err := ListShards(context.Background(), b, "train/", WebDataset, DefaultListBytes)
			if err != nil {
				t.Fatal(err)
			}
			seq = seq[:0]
			for epoch := range int64(epochs) {
				for _, sh := range ShardsForRank(all, 0, epoch, 0, 2) {
					seq = append(seq, sh.Name)
				}
				before := c.StorageReads()
				keys(t, b, c, Spec{BatchSize: 8, WorldSize: 2, Rank: 0, Epoch: epoch, ShuffleWindow: 1})
				if epoch > 0 {
					reads[ahead] += c.StorageReads() - before
				}
			}
		}
		var best int64
		for _, m := range beladyMisses(seq, fit, shards/2)[1:] {
			best += int64(m)
		}
		per := float64((epochs - 1) * shards / 2)
		t.Logf("dataset %.1fx the cache, one node of two: storage reads epochs 1-%d: lookahead %d, keep-what-you-hold %d, optimum %d (hit rate %.0f%%, %.0f%%, %.0f%%)",
			ratio, epochs-1, reads[true], reads[false], best,
			100*(1-float64(reads[true])/per), 100*(1-float64(reads[false])/per), 100*(1-float64(best)/per))
		if reads[true] >= reads[false] {
			t.Errorf("dataset %.1fx the cache: lookahead read %d shards, keep-what-you-hold %d", ratio, reads[true], reads[false])
		}
		if float64(reads[true]) > 1.05*float64(best)+1 {
			t.Errorf("dataset %.1fx the cache: lookahead read %d shards in epochs 1-%d, optimum %d", ratio, reads[true], epochs-1, best)
		}
	}
}

// A plan's present is its lookups: a read looked up holds its shard
// whatever the cache does, so only later reads count, and the shard a read
// brings in is judged by its next read after that one (else every shard
// read would look wanted at once, and be admitted over shards read sooner
// than its next read).
func TestLookaheadPresentIsTheLookups(t *testing.T) {
	l := newLookahead()
	p := l.register([]string{"a", "b", "c", "a", "b"})
	next, mine := l.distances(readAt{p, 0}, "a")
	if mine != 3 || next("b") != 1 || next("c") != 2 {
		t.Fatalf("before any lookup: a's next read %d reads away, want 3; b %d want 1; c %d want 2", mine, next("b"), next("c"))
	}
	l.lookedUp(readAt{p, 0})
	l.lookedUp(readAt{p, 2}) // ends before read 1's lookup
	if p.looked != 1 {
		t.Fatalf("looked %d after lookups 0 and 2, want 1", p.looked)
	}
	l.lookedUp(readAt{p, 1})
	next, mine = l.distances(readAt{p, 2}, "c")
	if p.looked != 3 || mine != math.MaxInt || next("a") != 0 || next("b") != 1 {
		t.Fatalf("after lookups 0-2: looked %d (want 3); c's next read %d (want none); a %d (want 0); b %d (want 1)",
			p.looked, mine, next("a"), next("b"))
	}
	q := l.register([]string{"c"}) // another iteration wants c next
	if _, mine = l.distances(readAt{p, 2}, "c"); mine != 0 {
		t.Fatalf("c's next read with another iteration about to read it: %d reads away, want 0", mine)
	}
	l.remove(q)
	l.remove(p)
	if next, _ := l.distances(readAt{}, "a"); next != nil {
		t.Fatal("distances with no plan open: want nil (admission's plain policy)")
	}
}
