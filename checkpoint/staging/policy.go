package staging

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
)

// The persistent tier policy decides which steps are drained to storage;
// the others are kept in memory only (see tiers.go). --persist-every N is
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
// of a step gets the same one.
type persistPolicy struct {
	mu      sync.Mutex
	last    map[string]time.Time // by job: when a step was last decided persisted
	decided map[stepKey]decision
}

type decision struct {
	persist bool
	at      time.Time
}

// maxDecisions bounds the decisions remembered; decisionTTL is how long
// one is kept at least (a step's ranks reach the drains within it).
const (
	maxDecisions = 4096
	decisionTTL  = 10 * time.Minute
)

func newPersistPolicy() *persistPolicy {
	return &persistPolicy{last: map[string]time.Time{}, decided: map[stepKey]decision{}}
}

// decide returns k's decision, making it if none was made: persisted when
// every divides the step, or when interval has passed since the job's last
// persisted step (or none was persisted since the daemon started).
// announce says the interval made it, so the peers must be told.
func (p *persistPolicy) decide(k stepKey, every int64, interval time.Duration, now time.Time) (persist, announce bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d, ok := p.decided[k]; ok {
		return d.persist, false
	}
	last, seen := p.last[k.job]
	switch {
	case every > 1 && k.step%every == 0:
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
	p.record(k, true, now)
	return ok && !d.persist
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
		for old, d := range p.decided {
			if now.Sub(d.at) > decisionTTL || len(p.decided) >= maxDecisions {
				delete(p.decided, old)
			}
		}
	}
	p.decided[k] = decision{persist: persist, at: now}
	if persist {
		p.last[k.job] = now
	}
}

// persists reports whether t's step goes to storage, telling the peers
// when the interval decided it.
func (mgr *Manager) persists(t checkpoint.Target) bool {
	every, interval := int64(mgr.cfg.PersistEvery), mgr.cfg.PersistInterval
	if !mgr.hot.enabled() || every <= 1 && interval <= 0 {
		return true
	}
	k := stepKey{t.Job, t.Step, t.Attempt}
	persist, announce := mgr.policy.decide(k, every, interval, time.Now())
	if announce && mgr.cfg.Peers != nil {
		mgr.background(func() {
			ctx, cancel := context.WithTimeout(mgr.ctx, replicateTimeout)
			defer cancel()
			if err := mgr.cfg.Peers.Persist(ctx, k.job, k.step, k.attempt); err != nil {
				mgr.m.failed("replicate")
				mgr.log.Warn("could not tell every peer that this step is persisted", "job", k.job, "step", k.step, "err", err)
			}
		})
	}
	return persist
}

// background runs fn on a goroutine the Manager waits for at Close,
// unless it is closing already.
func (mgr *Manager) background(fn func()) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if !mgr.closing {
		mgr.watchers.Go(fn)
	}
}

// PersistStep is a peer's word that it persisted step of job by attempt:
// this sidecar persists its own ranks of it too, those it kept in memory
// from the hot tier, and those still to come as they drain.
func (mgr *Manager) PersistStep(job string, step int64, attempt string) error {
	t := checkpoint.Target{Job: job, Step: step, WorldSize: 1, Attempt: attempt}
	if err := t.Validate(); err != nil {
		return err
	}
	if mgr.policy.tell(stepKey{job, step, attempt}, time.Now()) {
		mgr.persistHeld(job, step, attempt)
	}
	return nil
}

// persistHeld drains this sidecar's own shards of a step it kept in
// memory, from the hot tier (pinned meanwhile).
func (mgr *Manager) persistHeld(job string, step int64, attempt string) {
	for _, o := range mgr.hot.originals(job, step, attempt) {
		mgr.background(func() {
			defer o.release()
			mgr.persistEntry(o.e)
		})
	}
}

// persistEntry writes a shard kept in memory to storage and settles its
// step's commit, as a drain would.
func (mgr *Manager) persistEntry(e *hotEntry) {
	t := e.m.Target()
	layout, err := checkpoint.NewLayout(e.m.Tensors)
	if err != nil {
		mgr.log.Error("a shard kept in memory cannot be persisted", "target", t, "err", err)
		return
	}
	start := time.Now()
	mgr.setStateLocked(keyOf(t), StateDraining, nil)
	m, reused, err := mgr.writeRetrying(&checkpoint.Shard{Target: t, Layout: layout, Data: e.data, Metadata: e.m.Metadata})
	if err != nil {
		if err != errAbandoned {
			mgr.log.Error("persisting a shard kept in memory failed", "target", t, "err", err)
			mgr.markDone(keyOf(t), StateFailed, fmt.Errorf("persisting it when a peer persisted the step: %w", err))
		}
		return
	}
	mgr.log.Info("a peer persisted this step; persisted this sidecar's rank of it from memory", "target", t)
	mgr.recordDurable(t, m, reused, start)
	mgr.commitSettled(t)
}
