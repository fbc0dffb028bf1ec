package staging

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/storage"
)

// drainQueue is the accepted saves waiting for a drain worker, oldest
// first. Manager.mu guards saves; wake is signalled when the queue grows
// and when the Manager closes.
type drainQueue struct {
	saves []*lease
	wake  chan struct{}
}

func (q *drainQueue) push(l *lease) {
	q.saves = append(q.saves, l)
	q.signal()
}

// insertSpilled puts a save at the head of the queue, behind those there
// already moved to the spill folder, which are older: the queue stays
// oldest first.
func (q *drainQueue) insertSpilled(l *lease) {
	i := 0
	for i < len(q.saves) && q.saves[i].unmap != nil && !q.saves[i].begun.After(l.begun) {
		i++
	}
	q.saves = slices.Insert(q.saves, i, l)
	q.signal()
}

// takeInArena takes the oldest queued save that is in the arena off the
// queue, or returns nil.
func (q *drainQueue) takeInArena() *lease {
	for i, l := range q.saves {
		if l.region.Length > 0 {
			q.saves = append(q.saves[:i:i], q.saves[i+1:]...)
			return l
		}
	}
	return nil
}

// pop takes the oldest save off the queue, or returns nil.
func (q *drainQueue) pop() *lease {
	if len(q.saves) == 0 {
		return nil
	}
	l := q.saves[0]
	q.saves = q.saves[1:]
	if len(q.saves) > 0 {
		q.signal() // pass the wake-up on to another drain worker
	}
	return l
}

func (q *drainQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// enqueue adds an accepted save to the drain queue. Call with mu.
func (mgr *Manager) enqueue(l *lease) {
	mgr.queue.push(l)
	mgr.m.QueueDepth.Inc()
}

// next pops the oldest queued save, waiting for one; it returns nil when
// the manager closes and the queue is empty, or drains are abandoned.
func (mgr *Manager) next() *lease {
	for {
		mgr.mu.Lock()
		l, closing := mgr.queue.pop(), mgr.closing
		mgr.mu.Unlock()
		switch {
		case l != nil:
			return l
		case closing:
			mgr.queue.signal() // let the other workers see it too
			return nil
		}
		select {
		case <-mgr.queue.wake:
		case <-mgr.ctx.Done():
			return nil
		}
	}
}

// drainLoop is one drain worker; NewManager starts Drains of them.
func (mgr *Manager) drainLoop() {
	for l := mgr.next(); l != nil; l = mgr.next() {
		mgr.drain(l)
	}
}

// drain makes one save durable, retrying storage errors with backoff for
// as long as the daemon runs: the data is acknowledged, so giving up would
// lose it. Meanwhile it holds its region, so a storage outage turns into
// back-pressure (RESOURCE_EXHAUSTED on new saves), not data loss.
func (mgr *Manager) drain(l *lease) {
	k := keyOf(l.target)
	mgr.saves.set(k, StateDraining, nil)
	if !mgr.sleep(mgr.cfg.DrainDelay) {
		return
	}
	if !mgr.tiers.Persists(l.target) && mgr.keepInMemory(l) {
		return
	}
	if l.recovered {
		mgr.removeTemporaries(l.target)
	}
	start := time.Now()
	sh := &checkpoint.Shard{
		Target: l.target, Layout: l.layout, Metadata: l.metadata,
		Data: mgr.bytesOf(l), Check: l.copyCheck,
	}
	m, reused, err := mgr.writeRetrying(sh)
	switch {
	case err == nil:
		mgr.finishDrain(l, m, reused, start)
	case errors.Is(err, errAbandoned):
		mgr.log.Warn("drain abandoned at shutdown; save stays journaled", "target", l.target)
	default:
		mgr.refuse(l, err)
	}
}

// refuse ends a save that can never be stored.
func (mgr *Manager) refuse(l *lease, err error) {
	mgr.log.Error("save refused", "target", l.target, "err", err)
	if errors.Is(err, checkpoint.ErrStagedChanged) {
		mgr.m.failed("copy_check")
	}
	mgr.endDrain(l, StateFailed, err)
}

// removeTemporaries removes what the dead process's write of a replayed
// save left in storage, which nothing else would remove before prune's
// grace. Best effort, and bounded: storage that does not answer now only
// leaves them to prune.
func (mgr *Manager) removeTemporaries(t checkpoint.Target) {
	s, err := mgr.jobStore(t.Job)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(mgr.ctx, temporariesTimeout)
	defer cancel()
	s.RemoveRankTemporaries(ctx, t)
}

// temporariesTimeout bounds removeTemporaries: it must not hold back a
// replayed save's drain through a storage outage.
const temporariesTimeout = 30 * time.Second

// errAbandoned: the daemon shut down while a shard was being written.
var errAbandoned = errors.New("abandoned at shutdown")

// writeRetrying makes sh durable (writeShard), retrying storage errors
// with backoff for as long as the daemon runs; it fails when the save
// can never be written, or with errAbandoned at shutdown.
func (mgr *Manager) writeRetrying(sh *checkpoint.Shard) (*checkpoint.Manifest, bool, error) {
	backoff := newBackoff()
	for {
		m, reused, err := mgr.writeShard(sh)
		switch {
		case err == nil:
			mgr.stalled.Store(nil)
			return m, reused, nil
		case errors.Is(err, checkpoint.ErrExists) || errors.Is(err, checkpoint.ErrInvalid) || errors.Is(err, checkpoint.ErrCorrupt):
			return nil, false, err
		case mgr.ctx.Err() != nil:
			return nil, false, errAbandoned
		}
		mgr.m.failed("drain")
		since := time.Now()
		if s := mgr.stalled.Load(); s != nil {
			since = s.since
		}
		mgr.stalled.Store(&drainStall{since: since, err: err})
		mgr.log.Error("drain failed; retrying", "target", sh.Target, "in", backoff.d, "err", err)
		mgr.saves.set(keyOf(sh.Target), StateDraining, err)
		if !mgr.sleep(backoff.next()) {
			return nil, false, errAbandoned
		}
	}
}

// backoff doubles a wait from half a second up to 30 seconds.
type backoff struct{ d time.Duration }

func newBackoff() *backoff { return &backoff{d: 500 * time.Millisecond} }

// next returns the wait to make now and doubles the following one.
func (b *backoff) next() time.Duration {
	d := b.d
	b.d = min(2*b.d, 30*time.Second)
	return d
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
//   - not committed, other bytes stored: a second run reusing the
//     attempt id. Refused (ErrInvalid): overwriting could mix two runs'
//     ranks in one step, which attempts exist to prevent.
//   - not committed, nothing (or a damaged manifest) stored: write.
func (mgr *Manager) writeShard(sh *checkpoint.Shard) (m *checkpoint.Manifest, reused bool, err error) {
	t := sh.Target
	s, err := mgr.jobStore(t.Job)
	if err != nil {
		return nil, false, err
	}
	rec, err := s.ReadCommitShared(mgr.ctx, t) // one read for the node's ranks of the step
	if errors.Is(err, checkpoint.ErrCorrupt) { // a step is committed, but the record is unreadable: nothing can join it
		return nil, false, fmt.Errorf("step %d cannot take this save: %w (see ckptd verify)", t.Step, err)
	}
	if err != nil && !errors.Is(err, storage.ErrNotFound) {
		return nil, false, fmt.Errorf("check step %d: %w", t.Step, err) // retried
	}
	stored, err := s.RankManifest(mgr.ctx, t)
	switch {
	case err != nil && !errors.Is(err, storage.ErrNotFound) && !errors.Is(err, checkpoint.ErrCorrupt) && !errors.Is(err, checkpoint.ErrInvalid):
		return nil, false, fmt.Errorf("read the stored copy of %s: %w", t, err) // retried
	case rec != nil && rec.Attempt != t.Attempt:
		s.RemoveRank(mgr.ctx, t) // an earlier drain of this save may have written some of it
		return nil, false, &checkpoint.CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Detail: "this save was not written"}
	case err == nil && stored.Holds(sh):
		mgr.log.Warn("rank already stored with these bytes; not rewritten", "target", t)
		return stored, true, nil
	case rec != nil:
		return nil, false, &checkpoint.CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Mine: true,
			Detail: fmt.Sprintf("it was committed without these bytes for rank %d; this save was not written", t.Rank)}
	case err == nil:
		return nil, false, fmt.Errorf("%w: %s is stored already with other bytes: the attempt id was reused by another run "+
			"(each run of a job needs its own CKPTD_ATTEMPT); this save was not written", checkpoint.ErrInvalid, t)
	}
	m, err = mgr.w.WriteShard(mgr.ctx, sh)
	return m, false, err
}

// endDrain forgets a drained save: its journal entry, lease and region go,
// and its state becomes state unless it is final already.
func (mgr *Manager) endDrain(l *lease, state State, err error) {
	if l.unmap != nil {
		mgr.dropSpilled(l)
	} else if jerr := mgr.arena.Journal().Delete(l.id); jerr != nil {
		mgr.log.Error("journal delete failed", "lease", l.id, "err", jerr)
	}
	mgr.mu.Lock()
	mgr.leases.remove(l)
	mgr.freeRegion(l.region)
	mgr.saves.setUnlessFinal(keyOf(l.target), state, err)
	mgr.mu.Unlock()
	mgr.m.QueueDepth.Dec()
}

// finishDrain marks a save durable, settles its step's commit, then
// releases its region and journal entry. The journal entry goes only once
// the commit is settled: if this was the step's last rank and the commit
// failed, nobody else would ever commit the step, so the save stays
// journaled (a restarted daemon finds the same bytes stored and tries the
// commit again) and the commit is retried with backoff meanwhile.
func (mgr *Manager) finishDrain(l *lease, m *checkpoint.Manifest, reused bool, start time.Time) {
	t := l.target
	mgr.recordDurable(t, m, reused, start)
	if !mgr.commitSettled(t) {
		return // shutdown: the save stays journaled, and the commit is tried after the restart
	}
	// After the commit, so as not to delay it: the copy takes a while for a
	// large shard. It is kept committed if the commit record pins it.
	// Verified when others can write the arena: they may have since the drain.
	data, release, _ := mgr.tiers.Keep(m, l.layout, mgr.bytesOf(l), l.copyCheck)
	res, _, _ := mgr.saves.status(&saveKey{t.Job, t.Step, t.Rank, t.Attempt})
	if mgr.tiers.HasPeers() && data != nil {
		mgr.tiers.Replicate(m, data, res.State == StateCommitted, release)
	} else {
		release()
	}
	mgr.endDrain(l, StateDurable, nil)
}

// recordDurable marks a save durable, counts what its drain wrote and
// logs it.
func (mgr *Manager) recordDurable(t checkpoint.Target, m *checkpoint.Manifest, reused bool, start time.Time) {
	mgr.saves.set(keyOf(t), StateDurable, nil)
	if !reused { // the drain metrics count what this drain wrote
		mgr.m.DrainedBytes.Add(float64(m.DataSize))
		for _, c := range m.Chunks {
			if !m.Owns(c) {
				mgr.m.ReferencedBytes.Add(float64(c.Raw))
				continue
			}
			mgr.m.StoredBytes.Add(float64(c.Stored))
			mgr.m.CodecRaw.WithLabelValues(string(c.Codec)).Add(float64(c.Raw))
			mgr.m.CodecStored.WithLabelValues(string(c.Codec)).Add(float64(c.Stored))
		}
		mgr.m.DrainTime.Observe(time.Since(start).Seconds())
	}
	// One line per save, with stable keys (log shippers index them).
	mgr.log.Info("save durable", "job", t.Job, "step", t.Step, "rank", t.Rank, "attempt", t.Attempt,
		"bytes", m.DataSize, "stored", m.StoredSize, "duration", time.Since(start), "reused", reused)
	if values, tensors := m.NonFinite(); tensors > 0 && !reused {
		mgr.m.nonFinite(t.Job, tensors)
		mgr.log.Warn("save holds NaN or Inf: the run may have diverged (a finite load of latest passes over such steps)",
			"target", t, "values", values, "tensors", tensors)
	}
}

// commitSettled tries t's step's commit, as the drain that wrote t's
// rank (Store.TryCommitRank), until the outcome is known (see settle),
// with backoff; false when the daemon shuts down first.
func (mgr *Manager) commitSettled(t checkpoint.Target) bool {
	for b := newBackoff(); ; {
		_, err := mgr.settle(mgr.ctx, t, (*checkpoint.Store).TryCommitRank)
		if err == nil {
			return true
		}
		mgr.saves.set(keyOf(t), StateDurable, err) // waiters see why; refreshes the status's age
		if !mgr.sleep(b.next()) {
			return false
		}
	}
}

// tryCommit is a waiter's look at t's step (Store.PollCommit: shared by
// the step's waiters in this daemon, and committing the step itself only
// when its last rank's drain seems lost), settled as settle does.
func (mgr *Manager) tryCommit(ctx context.Context, t checkpoint.Target) (bool, error) {
	return mgr.settle(ctx, t, (*checkpoint.Store).PollCommit)
}

// settle commits t's step with check if t's attempt has every rank, and
// records the outcome for t's waiters: committed, or failed when another
// attempt committed the step (t's objects are then garbage, and removed)
// or its commit record is damaged. It reports whether the step is
// committed, by any attempt; an error means the check itself failed and
// must be retried.
func (mgr *Manager) settle(ctx context.Context, t checkpoint.Target,
	check func(*checkpoint.Store, context.Context, checkpoint.Target) (*checkpoint.CommitRecord, bool, error)) (bool, error) {
	s, err := mgr.jobStore(t.Job)
	if err != nil {
		return false, err
	}
	rec, won, err := check(s, ctx, t)
	switch {
	case errors.Is(err, checkpoint.ErrCorrupt):
		mgr.log.Error("the step's commit record is damaged; this save cannot join it", "target", t, "err", err)
		mgr.markDone(keyOf(t), StateFailed, err)
		return true, nil
	case err != nil:
		mgr.m.failed("commit")
		mgr.log.Warn("commit check failed; retrying", "target", t, "err", err)
		return false, err
	case rec == nil:
		return false, nil
	}
	mgr.tiers.MarkCommitted(t.Job, rec)
	switch {
	case rec.Attempt == t.Attempt:
		mgr.markDone(keyOf(t), StateCommitted, nil)
		mgr.m.committed(t.Job, t.Step, time.Now())
		if won { // one line per step, by the daemon whose commit record won
			mgr.log.Info("step committed", "job", t.Job, "step", t.Step, "attempt", t.Attempt, "world_size", t.WorldSize)
		}
	default:
		s.RemoveRank(mgr.ctx, t)
		err := &checkpoint.CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Detail: "this attempt's ranks were removed"}
		mgr.log.Warn("another attempt committed the step; this save's objects removed", "target", t, "committed_attempt", rec.Attempt)
		mgr.markDone(keyOf(t), StateFailed, err)
	}
	return true, nil
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
