package checkpoint

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/internal/codec"
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
		m, reused, err := mgr.writeShard(sh)
		if err == nil {
			mgr.finishDrain(l, m, reused, start)
			return
		}
		if errors.Is(err, ErrExists) {
			mgr.log.Error("save refused: its step is committed", "target", l.target.String(), "err", err)
			mgr.endDrain(l, StateFailed, err)
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

// writeShard makes sh durable, without ever rewriting a rank that a
// committed step may point to. Before writing it reads the rank's stored
// manifest:
//
//   - the same bytes (every chunk hash matches the staged data): a
//     journaled save replayed after a crash that came after its write. Keep
//     what is stored; rewriting it could race a commit that other ranks
//     make meanwhile, and with --codec auto the new chunks could differ
//     from the manifest a reader has just fetched.
//   - none, other bytes (an earlier attempt at this step), or an
//     unreadable manifest: write, unless the step is committed already
//     (without this save: by other ranks, or with another world size);
//     then fail with ErrExists, since the step is final.
func (mgr *Manager) writeShard(sh *Shard) (m *Manifest, reused bool, err error) {
	t := sh.Target
	stored, err := readManifest(mgr.ctx, mgr.b, manifestName(t.Job, t.Step, t.Rank))
	switch {
	case err == nil && holdsSame(stored, sh):
		mgr.log.Warn("rank already stored with these bytes; not rewritten", "target", t.String())
		return stored, true, nil
	case err != nil && !errors.Is(err, storage.ErrNotFound) && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrInvalid):
		return nil, false, fmt.Errorf("read the stored copy of %s: %w", t, err) // retried
	}
	// Nothing, other bytes, or an unreadable copy: write, unless the step
	// is final (committed by other ranks, maybe with another world size).
	_, err = (&Store{B: mgr.b, Job: t.Job}).readCommit(mgr.ctx, t.Step)
	switch {
	case errors.Is(err, storage.ErrNotFound):
		m, err = mgr.w.WriteShard(mgr.ctx, sh)
		return m, false, err
	case err != nil && !errors.Is(err, ErrCorrupt):
		return nil, false, fmt.Errorf("check step %d: %w", t.Step, err) // retried
	}
	return nil, false, fmt.Errorf("%w: step %d of job %q was committed without these bytes for rank %d; this save was not written",
		ErrExists, t.Step, t.Job, t.Rank)
}

// holdsSame reports whether m describes exactly sh: same target, tensors
// and metadata, and every chunk's hash that of sh's bytes.
func holdsSame(m *Manifest, sh *Shard) bool {
	if m.Target() != sh.Target || m.DataSize != sh.Layout.DataSize || !bytes.Equal(m.Metadata, sh.Metadata) ||
		!slices.EqualFunc(m.Tensors, sh.Layout.Packed, Tensor.equal) {
		return false
	}
	var buf []byte
	for _, c := range m.Chunks {
		spans, ok := sh.Layout.regionSpans(c.RawOffset, c.Raw)
		if !ok {
			return false
		}
		raw := gather(sh.Data, chunkPlan{spans: spans}, &buf)
		if codec.FormatHash(codec.Hash(raw)) != c.Hash {
			return false
		}
	}
	return true
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
func (mgr *Manager) finishDrain(l *lease, m *Manifest, reused bool, start time.Time) {
	mgr.endDrain(l, StateDurable, nil)
	if !reused { // the drain metrics count what this drain wrote
		mgr.m.DrainedBytes.Add(float64(m.DataSize))
		mgr.m.StoredBytes.Add(float64(m.StoredSize))
		for _, c := range m.Chunks {
			mgr.m.CodecRaw.WithLabelValues(string(c.Codec)).Add(float64(c.Raw))
			mgr.m.CodecStored.WithLabelValues(string(c.Codec)).Add(float64(c.Stored))
		}
		mgr.m.DrainTime.Observe(time.Since(start).Seconds())
	}
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
