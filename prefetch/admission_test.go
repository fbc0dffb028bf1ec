package prefetch

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

func TestAdmission(t *testing.T) {
	now := time.Unix(1000, 0)
	a := newAdmission(100, time.Minute)
	a.now = func() time.Time { return now }
	mustReserve := func(key, g string, size int64, want bool, wantEvict int) {
		t.Helper()
		evict, ok := a.reserve(key, g, size)
		if ok != want || len(evict) != wantEvict {
			t.Fatalf("reserve(%s, %s, %d) = %q, %v; want %d evictions, %v", key, g, size, evict, ok, wantEvict, want)
		}
	}
	mustReserve("a1", "A", 60, true, 0)
	mustReserve("a2", "A", 40, true, 0)
	mustReserve("a3", "A", 1, false, 0)    // full of A, which is in use: keep it
	mustReserve("b1", "B", 50, false, 0)   // A was used just now
	mustReserve("big", "C", 101, false, 0) // never fits
	now = now.Add(2 * time.Minute)
	a.used("B")
	mustReserve("b1", "B", 50, true, 1) // A went stale: one of its shards makes room
	if a.resident > a.budget {
		t.Fatalf("resident %d over the budget %d", a.resident, a.budget)
	}
	mustReserve("b2", "B", 50, true, 1) // and the other
	if a.resident != 100 || a.groups["A"] != nil {
		t.Fatalf("resident %d; the emptied stale group A is still kept: %v", a.resident, a.groups["A"])
	}
	h, c := hashAndConflict("b1")
	a.release(h, c)
	if a.resident != 50 {
		t.Fatalf("resident %d after releasing b1, want 50", a.resident)
	}
}

// Concurrent fills never book more than the budget.
func TestAdmissionConcurrent(t *testing.T) {
	a := newAdmission(1000, time.Minute)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 100 {
				a.reserve(fmt.Sprintf("k%d-%d", g, i), "G", 7)
			}
		})
	}
	wg.Wait()
	if a.resident > a.budget || a.resident != int64(len(a.entries))*7 {
		t.Fatalf("resident %d for %d entries, budget %d", a.resident, len(a.entries), a.budget)
	}
}
