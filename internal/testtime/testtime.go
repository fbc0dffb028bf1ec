// Package testtime gives tests one knob for a slow machine. Every wait of
// a test (for a daemon to start, a step to commit, a log line to appear) is
// a deadline on an event, never a sleep that hopes the event happened, and
// every such deadline is scaled by CKPTD_TEST_SLOWDOWN (a factor, 1 when
// unset), so that a slow machine sets one number instead of every test
// guessing.
// The deadlines hold at 1 on a machine whose every core another job keeps
// busy (make test-busy proves it); the factor is for slower ones still.
package testtime

import (
	"os"
	"strconv"
	"sync"
	"testing"
	"time"
)

// Factor is CKPTD_TEST_SLOWDOWN, at least 1.
var Factor = sync.OnceValue(func() float64 {
	f, err := strconv.ParseFloat(os.Getenv("CKPTD_TEST_SLOWDOWN"), 64)
	if err != nil || f < 1 {
		return 1
	}
	return f
})

// Scale is d stretched by the slowdown factor: a deadline, never a pause.
func Scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * Factor())
}

// Until polls cond every few milliseconds until it holds, failing the test
// with what was awaited once Scale(limit) has passed.
func Until(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Within(limit, cond) {
		t.Fatalf("%s: not within %v", what, Scale(limit))
	}
}

// Within polls cond until it holds (true) or Scale(limit) has passed
// (false), backing off from 1 ms to 100 ms between tries.
func Within(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(Scale(limit))
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			return cond()
		}
		time.Sleep(pause)
		pause = min(2*pause, 100*time.Millisecond)
	}
	return true
}
