package tiers

import (
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// Dropped shards' buffers are reused for the next shards (no fresh memory
// in steady state), within the budget, and never while pinned.
func TestHotTierReusesBuffers(t *testing.T) {
	h := newHotTier(1<<20, 2)
	layout, err := checkpoint.NewLayout([]checkpoint.Tensor{checkpoint.Tensor{Name: "w", DType: dtype.U8, Shape: []int64{300_000}, Length: 300_000}})
	if err != nil {
		t.Fatal(err)
	}
	region := make([]byte, 300_000)
	add := func(step int64) []byte {
		t.Helper()
		m := &checkpoint.Manifest{Format: checkpoint.ManifestFormat, Version: checkpoint.ManifestVersion, Job: "job", Step: step, WorldSize: 1, Attempt: "a",
			DataSize: 300_000, Tensors: layout.Packed}
		region[0] = byte(step)
		data, release, kept := h.add(m, layout, region, true)
		release()
		if !kept || data[0] != byte(step) {
			t.Fatalf("step %d not kept", step)
		}
		if used, budget, _ := h.stats(); used > budget {
			t.Fatalf("step %d: %d bytes held of a %d budget", step, used, budget)
		}
		return data
	}
	d1, _ := add(1), add(2)
	d3 := add(3) // step 1 goes (2 steps kept): its buffer is spare
	if &d3[0] != &d1[0] {
		t.Fatal("step 3 did not reuse step 1's buffer")
	}
	e, release := h.getAny("job", 2, 0, "a") // a restore reads step 2
	if e == nil {
		t.Fatal("step 2 not held")
	}
	d4 := add(4)
	d5 := add(5)
	if &d4[0] == &e.data[0] || &d5[0] == &e.data[0] || e.data[0] != 2 {
		t.Fatal("a pinned shard's buffer was reused")
	}
	release()
	if d6 := add(6); &d6[0] != &e.data[0] && &d6[0] != &d4[0] { // steps 2 and 4 went
		t.Fatal("step 6 took fresh memory with spares at hand")
	}
}
