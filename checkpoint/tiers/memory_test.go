package tiers

import "testing"

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
