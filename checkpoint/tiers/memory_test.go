package tiers

import (
	"slices"
	"testing"
)

// A rank held here and at peers is read from here: the inventories come
// as a map, whose order must not decide between this node's memory and
// a copy over the network.
func TestMemoryOnlyHoldersLocalFirst(t *testing.T) {
	shard := func(rank int) HeldShard {
		return HeldShard{Step: 7, Rank: rank, WorldSize: 2, Attempt: "run1", MemoryOnly: true}
	}
	inv := map[string][]HeldShard{
		"":           {shard(0), shard(1)},
		"10.0.0.2:1": {shard(1)},
		"10.0.0.3:1": {shard(0)},
		"10.0.0.4:1": {shard(1)},
	}
	for range 50 { // map order differs from run to run
		steps := memoryOnly(inv)
		if len(steps) != 1 || !steps[0].whole() {
			t.Fatalf("steps: %+v", steps)
		}
		for rank, hs := range steps[0].holders {
			if len(hs) < 2 || hs[0].addr != "" {
				t.Fatalf("rank %d's holders %+v: this sidecar is not first", rank, hs)
			}
		}
	}
}

// The copies of a memory-only step are pinned to the original's: a copy
// that differs from it is left out, and a rank whose copies cannot be
// told apart (two originals, or differing replicas with the original's
// sidecar gone) is held nowhere, so an older step is restored instead.
func TestMemoryOnlyPinnedToTheOriginal(t *testing.T) {
	const good, forged = "xxh3:0000000000000001", "xxh3:00000000000000ff"
	shard := func(rank int, hash string, original bool) HeldShard {
		return HeldShard{Step: 7, Rank: rank, WorldSize: 1, Attempt: "run1", MemoryOnly: true, ManifestHash: hash, Original: original}
	}
	for _, tc := range []struct {
		name      string
		inv       map[string][]HeldShard
		holders   []string // rank 0's, in order; nil: contested
		differing int
	}{
		{"replicas agree with the original", map[string][]HeldShard{
			"a:1": {shard(0, good, true)}, "b:1": {shard(0, good, false)}, "c:1": {shard(0, good, false)},
		}, []string{"a:1", "b:1", "c:1"}, 0},
		{"a forged replica beside the original", map[string][]HeldShard{
			"a:1": {shard(0, forged, false)}, "b:1": {shard(0, good, true)}, "c:1": {shard(0, good, false)},
		}, []string{"b:1", "c:1"}, 1},
		{"the original here, a forged replica there", map[string][]HeldShard{
			"": {shard(0, good, true)}, "a:1": {shard(0, forged, false)},
		}, []string{""}, 1},
		{"a second sidecar claims the original", map[string][]HeldShard{
			"a:1": {shard(0, forged, true)}, "b:1": {shard(0, good, true)}, "c:1": {shard(0, good, false)},
		}, nil, 0},
		{"a peer claims the original held here", map[string][]HeldShard{
			"": {shard(0, good, true)}, "a:1": {shard(0, forged, true)}, "b:1": {shard(0, good, false)},
		}, []string{"", "b:1"}, 1},
		{"the original's node lost, replicas agree", map[string][]HeldShard{
			"a:1": {shard(0, good, false)}, "b:1": {shard(0, good, false)},
		}, []string{"a:1", "b:1"}, 0},
		{"the original's node lost, replicas differ", map[string][]HeldShard{
			"a:1": {shard(0, forged, false)}, "b:1": {shard(0, good, false)},
		}, nil, 0},
		{"one replica left", map[string][]HeldShard{"a:1": {shard(0, good, false)}}, []string{"a:1"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			steps := memoryOnly(tc.inv)
			if len(steps) != 1 {
				t.Fatalf("steps: %+v", steps)
			}
			s := steps[0]
			if tc.holders == nil {
				if s.whole() || len(s.contested) != 1 {
					t.Fatalf("a contested rank is held: %+v", s)
				}
				return
			}
			var got []string
			for _, h := range s.holders[0] {
				got = append(got, h.addr)
			}
			if !s.whole() || !slices.Equal(got, tc.holders) || s.differing != tc.differing {
				t.Fatalf("holders %v, differing %d; want %v, %d", got, s.differing, tc.holders, tc.differing)
			}
		})
	}
}
