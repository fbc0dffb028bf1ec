package checkpoint

import (
	"bytes"
	"context"
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
		if errors.Is(err, ErrExists) || errors.Is(err, ErrInvalid) {
			mgr.log.Error("save refused", "target", l.target, "err", err)
			mgr.endDrain(l, StateFailed, err)
			return
		}
		if mgr.ctx.Err() != nil {
			mgr.log.Warn("drain abandoned at shutdown; save stays journaled", "target", l.target)
			return
		}
		mgr.m.Error("drain")
		mgr.log.Error("drain failed; retrying", "target", l.target, "in", backoff, "err", err)
		mgr.setStateLocked(k, StateDraining, err)
		if !mgr.sleep(backoff) {
			return
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// writeShard makes sh durable in its attempt's folder, without ever
// rewriting a rank that a committed step may point to. It reads the
// step's commit record first, then the rank's stored manifest:
//
//   - committed by another attempt: the save can never be part of the
//     step. Whatever an earlier drain of it left is removed, and the save
//     fails with a CommittedError naming the winner.
//   - committed by this attempt: a journaled save replayed after a crash
//     that came after the commit. Keep what is stored if it holds the same
//     bytes; anything else fails, since the step is final.
//   - not committed, the same bytes stored (every chunk hash matches): a
//     replay after a crash that came after the write. Keep what is stored;
//     rewriting could race a commit other ranks make meanwhile, and with
//     --codec auto the new chunks could differ from a manifest a reader
//     has just fetched.
//   - not committed, nothing or other bytes stored: write.
func (mgr *Manager) writeShard(sh *Shard) (m *Manifest, reused bool, err error) {
	t := sh.Target
	rec, err := mgr.store(t.Job).readCommit(mgr.ctx, t.Step)
	if err != nil && !errors.Is(err, storage.ErrNotFound) {
		return nil, false, fmt.Errorf("check step %d: %w", t.Step, err) // retried
	}
	stored, err := readManifest(mgr.ctx, mgr.b, manifestName(t))
	switch {
	case err != nil && !errors.Is(err, storage.ErrNotFound) && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrInvalid):
		return nil, false, fmt.Errorf("read the stored copy of %s: %w", t, err) // retried
	case rec != nil && rec.Attempt != t.Attempt:
		mgr.removeRank(t) // an earlier drain of this save may have written some of it
		return nil, false, &CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Detail: "this save was not written"}
	case err == nil && holdsSame(stored, sh):
		mgr.log.Warn("rank already stored with these bytes; not rewritten", "target", t)
		return stored, true, nil
	case rec != nil:
		return nil, false, &CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Mine: true,
			Detail: fmt.Sprintf("it was committed without these bytes for rank %d; this save was not written", t.Rank)}
	}
	m, err = mgr.w.WriteShard(mgr.ctx, sh)
	return m, false, err
}

// removeRank deletes what a drain of t wrote, best effort: the step was
// committed by another attempt, so it is garbage (prune would remove it
// later if this fails).
func (mgr *Manager) removeRank(t Target) {
	for _, name := range []string{manifestName(t), inJob(t.Job, dataObject(t.Step, t.Attempt, t.Rank))} {
		if err := mgr.b.Delete(mgr.ctx, name); err != nil {
			mgr.log.Warn("could not remove the objects of a save its step will never use; prune removes them", "object", name, "err", err)
		}
	}
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
	mgr.uncharge(l)
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
	t := l.target // one line per save, with stable keys (log shippers index them)
	mgr.log.Info("save durable", "job", t.Job, "step", t.Step, "rank", t.Rank, "attempt", t.Attempt,
		"bytes", m.DataSize, "stored", m.StoredSize, "duration", time.Since(start), "reused", reused)

	mgr.tryCommit(mgr.ctx, l.target)
}

// tryCommit commits t's step if t's attempt has every rank, and records
// the outcome for t's waiters: committed, or failed when another attempt
// committed the step (t's objects are then garbage, and removed). It
// reports whether the step is committed, by any attempt.
func (mgr *Manager) tryCommit(ctx context.Context, t Target) bool {
	rec, won, err := TryCommit(ctx, mgr.b, t.Job, t.Step, t.Attempt, t.WorldSize)
	switch {
	case err != nil:
		mgr.m.Error("commit")
		mgr.log.Warn("commit check failed; waiters will retry", "target", t, "err", err)
		return false
	case rec == nil:
		return false
	case rec.Attempt == t.Attempt:
		mgr.markDone(keyOf(t), StateCommitted, nil)
		if won { // the end-to-end tests count these lines: one per step
			mgr.log.Info("step committed", "job", t.Job, "step", t.Step, "attempt", t.Attempt, "world_size", t.WorldSize)
		}
	default:
		mgr.removeRank(t)
		err := &CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Detail: "this attempt's ranks were removed"}
		mgr.log.Warn("another attempt committed the step; this save's objects removed", "target", t, "committed_attempt", rec.Attempt)
		mgr.markDone(keyOf(t), StateFailed, err)
	}
	return true
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
