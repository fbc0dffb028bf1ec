package tiers

import (
	"slices"
	"sync"
	"time"
)

// The persistent tier policy decides which steps are drained to storage;
// the others are kept in memory only (see memory.go). --persist-every N is
// a function of the step, the same on every sidecar. --persist-interval D
// is a function of time, which sidecars see each from its own clock and
// its own moment: near the boundary one may persist a step another keeps
// in memory, and the step would never commit. So a sidecar that persists
// a step because of the interval tells its peers (Peers.Persist), and a
// sidecar told so persists its own ranks of that step as well, from the
// hot tier if it kept them in memory already. Decisions converge without a
// coordinator; their timers restart at every persisted step, so they stay
// in phase.

// stepKey names one step of one attempt of a job.
type stepKey struct {
	job     string
	step    int64
	attempt string
}

// persistPolicy remembers each step's decision, so that every local rank
// of a step gets the same one, and the peers' word that they persisted a
// step this sidecar has not decided yet. A peer's word changes only
// decisions made here (each at most once: to persist) and is kept apart
// and bounded otherwise, so that notices of steps that never come
// neither hold back --persist-interval (which restarts at every step
// persisted) nor grow without bound.
type persistPolicy struct {
	mu      sync.Mutex
	last    map[string]time.Time // by job: when a step was last decided persisted
	decided map[stepKey]decision
	told    map[stepKey]time.Time // steps peers persisted, not decided here yet
}

type decision struct {
	persist bool
	at      time.Time
}

// maxDecisions bounds the decisions remembered, and the peers' notices of
// steps not decided yet; decisionTTL is how long one is kept at least (a
// step's ranks reach the drains within it).
const (
	maxDecisions = 4096
	decisionTTL  = 10 * time.Minute
)

func newPersistPolicy() *persistPolicy {
	return &persistPolicy{last: map[string]time.Time{}, decided: map[stepKey]decision{}, told: map[stepKey]time.Time{}}
}

// decide returns k's decision, making it if none was made: persisted when
// every divides the step, when a peer said it persisted it, or when
// interval has passed since the job's last persisted step (or none was
// persisted since the daemon started). announce says the interval made
// it, so the peers must be told.
func (p *persistPolicy) decide(k stepKey, every int64, interval time.Duration, now time.Time) (persist, announce bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d, ok := p.decided[k]; ok {
		return d.persist, false
	}
	last, seen := p.last[k.job]
	_, told := p.told[k]
	delete(p.told, k)
	switch {
	case every > 1 && k.step%every == 0, told:
		persist = true
	case interval > 0 && (!seen || now.Sub(last) >= interval):
		persist, announce = true, true
	}
	p.record(k, persist, now)
	return persist, announce
}

// tell records that a peer persisted k; it reports whether k had been
// decided here to stay in memory (its held ranks must now be persisted).
func (p *persistPolicy) tell(k stepKey, now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	d, ok := p.decided[k]
	switch {
	case ok && !d.persist:
		p.record(k, true, now)
		return true
	case ok:
		return false
	}
	if len(p.told) >= maxDecisions {
		forgetOld(p.told, func(at time.Time) time.Time { return at }, now)
	}
	p.told[k] = now
	return false
}

// persisted reports whether k is decided persisted.
func (p *persistPolicy) persisted(k stepKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.decided[k].persist
}

// record keeps a decision, forgetting old ones beyond maxDecisions. Call
// with mu.
func (p *persistPolicy) record(k stepKey, persist bool, now time.Time) {
	if len(p.decided) >= maxDecisions {
		forgetOld(p.decided, func(d decision) time.Time { return d.at }, now)
		for job := range p.last {
			if now.Sub(p.last[job]) > decisionTTL && len(p.last) >= maxDecisions {
				delete(p.last, job)
			}
		}
	}
	p.decided[k] = decision{persist: persist, at: now}
	if persist {
		p.last[k.job] = now
	}
}

// forgetOld drops the entries of m older than decisionTTL, then the oldest
// until a quarter of maxDecisions is free.
func forgetOld[V any](m map[stepKey]V, at func(V) time.Time, now time.Time) {
	keys := make([]stepKey, 0, len(m))
	for k, v := range m {
		if now.Sub(at(v)) > decisionTTL {
			delete(m, k)
		} else {
			keys = append(keys, k)
		}
	}
	if excess := len(m) - maxDecisions*3/4; excess > 0 {
		slices.SortFunc(keys, func(a, b stepKey) int { return at(m[a]).Compare(at(m[b])) })
		for _, k := range keys[:excess] {
			delete(m, k)
		}
	}
}
