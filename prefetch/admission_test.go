package prefetch

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/dgraph-io/ristretto/v2/z"
)

func TestAdmission(t *testing.T) {
	now := time.Unix(1000, 0)
	a := newAdmission(100, time.Minute)
	a.now = func() time.Time { return now }
	reserve := func(key, g string, size int64, want bool) []string {
		t.Helper()
		evict, ok := a.reserve(key, g, size, nil, 0)
		if ok != want || !ok && len(evict) != 0 {
			t.Fatalf("reserve(%s, %s, %d) = %q, %v; want %v", key, g, size, evict, ok, want)
		}
		if a.resident > a.budget {
			t.Fatalf("resident %d over the budget %d", a.resident, a.budget)
		}
		return evict
	}
	reserve("a1", "A", 60, true)
	reserve("a2", "A", 40, true)
	reserve("a3", "A", 1, false)    // full of A, which is in use: keep it
	reserve("b1", "B", 50, false)   // A was used just now
	reserve("big", "C", 101, false) // never fits
	now = now.Add(2 * time.Minute)
	a.used("B")
	evicted := reserve("b1", "B", 50, true) // A went stale: its shards make room
	evicted = append(evicted, reserve("b2", "B", 50, true)...)
	slices.Sort(evicted)
	if !slices.Equal(evicted, []string{"a1", "a2"}) || a.resident != 100 || a.groups["A"] != nil {
		t.Fatalf("evicted %q, resident %d, group A %v; want A's two shards gone and B's in", evicted, a.resident, a.groups["A"])
	}
	h, c := z.KeyToHash("b1")
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
				a.reserve(fmt.Sprintf("k%d-%d", g, i), "G", 7, nil, 0)
			}
		})
	}
	wg.Wait()
	if a.resident > a.budget || a.resident != int64(len(a.entries))*7 {
		t.Fatalf("resident %d for %d entries, budget %d", a.resident, len(a.entries), a.budget)
	}
}
