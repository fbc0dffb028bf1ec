package tiers

import (
	"fmt"
	"testing"
	"time"
)

// The policy's decisions: every N by step, the interval by time since the
// job's last persisted step (the first step always), one decision per
// step whatever the clock does next, and a peer's word overriding a
// memory-only decision.
func TestPersistPolicy(t *testing.T) {
	p := newPersistPolicy()
	t0 := time.Unix(1000, 0)
	k := func(step int64) stepKey { return stepKey{"job", step, "a"} }
	for _, tc := range []struct {
		step     int64
		every    int64
		interval time.Duration
		at       time.Duration
		persist  bool
		announce bool
	}{
		{1, 0, time.Minute, 0, true, true},                  // the first since start
		{2, 0, time.Minute, 10 * time.Second, false, false}, // within the interval
		{2, 0, time.Minute, 2 * time.Minute, false, false},  // decided already: the same answer
		{3, 0, time.Minute, 61 * time.Second, true, true},   // the interval passed
		{4, 4, time.Minute, 62 * time.Second, true, false},  // every 4th, whatever the time
		{5, 4, time.Minute, 63 * time.Second, false, false}, // the timer restarted at step 4
	} {
		persist, announce := p.decide(k(tc.step), tc.every, tc.interval, t0.Add(tc.at))
		if persist != tc.persist || announce != tc.announce {
			t.Fatalf("step %d: persist %v announce %v, want %v %v", tc.step, persist, announce, tc.persist, tc.announce)
		}
	}
	if !p.tell(k(5), t0) || !p.persisted(k(5)) {
		t.Fatal("a peer's word did not turn step 5 persisted")
	}
	if p.tell(k(6), t0) {
		t.Fatal("a peer's word on a step not yet decided had held ranks persisted")
	}
	if persist, announce := p.decide(k(6), 0, time.Minute, t0.Add(64*time.Second)); !persist || announce {
		t.Fatal("a peer's word on a step not yet decided did not make it persisted")
	}
	for i := range int64(2 * maxDecisions) {
		p.decide(k(100+i), 0, time.Minute, t0.Add(time.Hour))
	}
	if len(p.decided) > maxDecisions {
		t.Fatalf("%d decisions remembered", len(p.decided))
	}
}

// A peer's notices of steps that never come (a buggy or hostile peer)
// are bounded, and hold back neither the interval nor the decisions made
// here.
func TestPersistNoticesBounded(t *testing.T) {
	p := newPersistPolicy()
	t0 := time.Unix(1000, 0)
	if persist, _ := p.decide(stepKey{"job", 1, "a"}, 0, time.Minute, t0); !persist {
		t.Fatal("the first step is persisted")
	}
	for i := range int64(4 * maxDecisions) {
		p.tell(stepKey{"job", 1_000_000 + i, "a"}, t0.Add(time.Duration(i)*time.Millisecond))
		p.tell(stepKey{fmt.Sprintf("job%d", i), 5, "a"}, t0)
	}
	if len(p.told) > maxDecisions || len(p.last) > 1 {
		t.Fatalf("%d notices and %d jobs remembered", len(p.told), len(p.last))
	}
	if persist, _ := p.decide(stepKey{"job", 2, "a"}, 0, time.Minute, t0.Add(30*time.Second)); persist {
		t.Fatal("step 2, within the interval, persisted")
	}
	if persist, announce := p.decide(stepKey{"job", 3, "a"}, 0, time.Minute, t0.Add(61*time.Second)); !persist || !announce {
		t.Fatal("the notices held the interval back")
	}
}
