package staging

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The commit gauges follow the newest step of each job, never go back,
// and keep at most maxCommitJobs jobs (the longest idle goes).
func TestCommitGauges(t *testing.T) {
	m := NewMetrics(nil)
	t0 := time.Unix(1000, 0)
	m.committed("a", 5, t0)
	m.committed("a", 3, t0.Add(time.Second)) // an older step committed late
	if got := testutil.ToFloat64(m.LastCommitted.WithLabelValues("a")); got != 5 {
		t.Fatalf("last committed step %v, want 5", got)
	}
	if got := testutil.ToFloat64(m.LastCommitTime.WithLabelValues("a")); got != 1000 {
		t.Fatalf("last commit time %v, want 1000", got)
	}
	for i := range maxCommitJobs + 10 {
		m.committed(fmt.Sprintf("j%d", i), 1, t0.Add(time.Duration(i+2)*time.Second))
	}
	if n := testutil.CollectAndCount(m.LastCommitted); n != maxCommitJobs {
		t.Fatalf("%d jobs in the gauge, want %d", n, maxCommitJobs)
	}
	if _, ok := m.newest["a"]; ok {
		t.Fatal("the longest idle job was kept")
	}
}
