package checkpoint

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// enqueue adds an accepted save to the drain queue. Call with mu.
func (mgr *Manager) enqueue(l *lease) {
	mgr.queue = append(mgr.queue, l)
	mgr.m.QueueDepth.Inc()
	mgr.signal()
}

// next pops the oldest queued save, waiting for one; it returns nil when
// the manager closes and the queue is empty, or drains are abandoned.
func (mgr *Manager) next() *lease {
	for {
		mgr.mu.Lock()
		if len(mgr.queue) > 0 {
			l := mgr.queue[0]
			mgr.queue = mgr.queue[1:]
			mgr.active++
			more := len(mgr.queue) > 0
			mgr.mu.Unlock()
			if more {
				mgr.signal() // pass the wake-up on to another drain worker
			}
			return l
		}
		closing := mgr.closing
		mgr.mu.Unlock()
		if closing {
			mgr.signal() // let the other workers see it too
			return nil
		}
		select {
		case <-mgr.wake:
		case <-mgr.ctx.Done():
			return nil
		}
	}
}

// drainLoop is one drain worker; NewManager starts Drains of them.
func (mgr *Manager) drainLoop() {
	for {
		l := mgr.next()
		if l == nil {
			return
		}
		mgr.drain(l)
		mgr.mu.Lock()
		mgr.active--
		mgr.mu.Unlock()
	}
}

// drain makes one save durable, retrying storage errors with backoff for
// as long as the daemon runs: the data is acknowledged, so giving up would
// lose it. Meanwhile it holds its region, so a storage outage turns into
// back-pressure (RESOURCE_EXHAUSTED on new saves), not data loss.
func (mgr *Manager) drain(l *lease) {
	k := keyOf(l.target)
	mgr.setStateLocked(k, StateDraining, nil)
	if !mgr.sleep(mgr.cfg.DrainDelay) {
		return
	}
	start := time.Now()
	sh := &Shard{
		Target: l.target, Layout: l.layout, Metadata: l.metadata,
		Data: mgr.arena.Bytes()[l.region.Offset : l.region.Offset+l.size],
	}
	backoff := 500 * time.Millisecond
	for {
		m, stored, err := mgr.writeUnlessCommitted(sh)
		if err == nil && stored != nil {
			mgr.skipDrain(l, stored)
			return
		}
		if err == nil {
			mgr.finishDrain(l, m, start)
			return
		}
		if mgr.ctx.Err() != nil {
			mgr.log.Warn("drain abandoned at shutdown; save stays journaled", "target", l.target.String())
			return
		}
		mgr.m.Error("drain")
		mgr.log.Error("drain failed; retrying", "target", l.target.String(), "in", backoff, "err", err)
		mgr.setStateLocked(k, StateDraining, err)
		if !mgr.sleep(backoff) {
			return
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// writeUnlessCommitted writes the shard, unless its step is committed
// already; then it writes nothing and returns the committed manifest of
// the rank. Rewriting the data object under a committed manifest would
// corrupt the step. This happens when a journaled save is replayed after a
// crash that came between its commit and its journal delete (the bytes are
// already stored), or when another node saved the same rank.
func (mgr *Manager) writeUnlessCommitted(sh *Shard) (written, stored *Manifest, err error) {
	store := &Store{B: mgr.b, Job: sh.Target.Job}
	rec, err := store.readCommit(mgr.ctx, sh.Target.Step)
	switch {
	case errors.Is(err, storage.ErrNotFound):
		written, err = mgr.w.WriteShard(mgr.ctx, sh)
		return written, nil, err
	case err != nil:
		return nil, nil, fmt.Errorf("check step %d: %w", sh.Target.Step, err)
	}
	if stored, err = store.Manifest(mgr.ctx, rec, sh.Target.Rank); err != nil {
		return nil, nil, err
	}
	return nil, stored, nil
}

// skipDrain ends a save whose step was committed before it was written:
// committed if the stored rank holds the same tensors (this very save,
// replayed), failed otherwise.
func (mgr *Manager) skipDrain(l *lease, stored *Manifest) {
	state, err := StateCommitted, error(nil)
	if stored.DataSize != l.layout.DataSize || !slices.EqualFunc(stored.Tensors, l.layout.Packed, Tensor.equal) {
		state = StateFailed
		err = fmt.Errorf("%w: step %d of job %q was committed with another rank %d before this save was written; not overwritten",
			ErrExists, l.target.Step, l.target.Job, l.target.Rank)
	}
	mgr.log.Warn("step already committed; save not rewritten", "target", l.target.String(), "state", state.String())
	mgr.endDrain(l, state, err)
}

// endDrain forgets a drained save: its journal entry, lease and region go,
// and its state becomes state.
func (mgr *Manager) endDrain(l *lease, state State, err error) {
	if jerr := mgr.arena.Journal().Delete(l.id); jerr != nil {
		mgr.log.Error("journal delete failed", "lease", l.id, "err", jerr)
	}
	mgr.mu.Lock()
	delete(mgr.leases, l.id)
	mgr.freeRegion(l.region)
	mgr.setState(keyOf(l.target), state, err)
	mgr.mu.Unlock()
	mgr.m.QueueDepth.Dec()
}

// finishDrain releases a durable save's region and journal entry, then
// tries to commit its step.
func (mgr *Manager) finishDrain(l *lease, m *Manifest, start time.Time) {
	mgr.endDrain(l, StateDurable, nil)
	mgr.m.DrainedBytes.Add(float64(m.DataSize))
	mgr.m.StoredBytes.Add(float64(m.StoredSize))
	for _, c := range m.Chunks {
		mgr.m.CodecRaw.WithLabelValues(string(c.Codec)).Add(float64(c.Raw))
		mgr.m.CodecStored.WithLabelValues(string(c.Codec)).Add(float64(c.Stored))
	}
	mgr.m.DrainTime.Observe(time.Since(start).Seconds())
	mgr.log.Debug("save durable", "target", l.target.String(), "bytes", m.DataSize, "stored", m.StoredSize, "took", time.Since(start))

	t := l.target
	ok, won, err := TryCommit(mgr.ctx, mgr.b, t.Job, t.Step, t.WorldSize)
	if err != nil {
		mgr.m.Error("commit")
		mgr.log.Warn("commit check failed; waiters will retry", "step", t.Step, "err", err)
	}
	if ok {
		mgr.markCommitted(keyOf(t))
		mgr.logCommit(t.Job, t.Step, won)
	}
}

// logCommit logs the commit record this daemon wrote; the end-to-end tests
// count these lines to check that a step is committed exactly once.
func (mgr *Manager) logCommit(job string, step int64, won bool) {
	if won {
		mgr.log.Info("step committed", "job", job, "step", step)
	}
}

func (mgr *Manager) setStateLocked(k saveKey, s State, err error) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	mgr.setState(k, s, err)
}

// sleep waits d unless the manager is abandoning drains.
func (mgr *Manager) sleep(d time.Duration) bool {
	if d <= 0 {
		return true
	}
	select {
	case <-time.After(d):
		return true
	case <-mgr.ctx.Done():
		return false
	}
}
