package staging

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/storage"
)

// MaxMetadata bounds the trainer's opaque metadata per save. It stays well
// under the daemon's 16 MiB gRPC message limit, which CommitSave must fit.
const MaxMetadata = 8 << 20

// BeginSave validates a save request and leases a region for its tensors,
// waiting up to StagingWait for space. The region is owner's to fill until
// CommitSave or AbortSave, or until owner goes away.
func (mgr *Manager) BeginSave(ctx context.Context, o Owner, t checkpoint.Target, tensors []checkpoint.Tensor) (LeaseInfo, error) {
	start := time.Now()
	t.Job = mgr.job(t.Job)
	if err := t.Validate(); err != nil {
		return LeaseInfo{}, err
	}
	layout, err := checkpoint.NewLayout(tensors)
	if err != nil {
		return LeaseInfo{}, err
	}
	l := &lease{id: newLeaseID(), kind: saveLease, size: layout.RegionSize, target: t, layout: layout, begun: start}
	if mgr.cfg.CheckCopies {
		l.copyCheck = checkpoint.NewCopyCheck(mgr.w.CheckEnds(layout))
	}
	if err := mgr.seenCommitted(t); err != nil {
		return LeaseInfo{}, err
	}
	if err := mgr.reserveSave(l); err != nil {
		return LeaseInfo{}, err
	}
	l.check = mgr.startPrecheck(t)
	region, err := mgr.allocWriter(ctx, layout.RegionSize)
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if err != nil {
		mgr.saves.clearStaging(t)
		mgr.leases.uncharge(l)
		return LeaseInfo{}, fmt.Errorf("stage %s: %w", t, err)
	}
	l.region, l.expires = region, time.Now().Add(mgr.cfg.LeaseTimeout)
	if err := mgr.addLease(l, o); err != nil {
		return LeaseInfo{}, err
	}
	return l.info(), nil
}

// seenCommitted refuses a save of a step this daemon saw committed (its
// registry of saves), before the client copies anything: a client whose
// CommitSave answer was lost in a restart asks again, and is told its
// save is in. Storage has the last word (a commit record may have been
// pruned since): it is asked, unless it is seen down.
func (mgr *Manager) seenCommitted(t checkpoint.Target) error {
	attempt, ok := mgr.saves.committedBy(t.Job, t.Step)
	if !ok {
		return nil
	}
	seen := &checkpoint.CommittedError{Job: t.Job, Step: t.Step, Attempt: attempt, Mine: attempt == t.Attempt}
	if mgr.storageDown.Load() || mgr.stalled.Load() != nil {
		return seen
	}
	c := mgr.startPrecheck(t)
	<-c.done
	if !mgr.storageDown.Load() {
		return c.err
	}
	return seen
}

// reserveSave refuses a save of a rank this daemon is already saving for
// the same attempt, books the lease's tensor table against TableBudget,
// and marks the rank as being staged. It reads no storage: whether the
// step is committed is checked beside the client's copy (startPrecheck)
// and refused at CommitSave.
func (mgr *Manager) reserveSave(l *lease) error {
	t := l.target
	if _, err := mgr.jobStore(t.Job); err != nil {
		return err
	}
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if mgr.closing {
		return ErrClosing
	}
	k := keyOf(t)
	if state, ok := mgr.saves.unsettled(k); ok {
		return &InProgressError{Target: t, State: state}
	}
	if err := mgr.leases.charge(l, tableCost(l)); err != nil {
		return err
	}
	mgr.saves.setWorld(k, StateStaging, nil, t.WorldSize)
	return nil
}

// tableCost estimates the memory a lease's tensor table holds while the
// save is open: the region and packed tables (which share names and
// shapes), its copy check, and the journal entry in shared memory.
func tableCost(ls *lease) int64 {
	l := ls.layout
	n := int64(512)
	for _, t := range l.Region {
		n += 256 + 2*int64(len(t.Name)) + 24*int64(len(t.Shape))
	}
	if ls.copyCheck != nil { // ends and hashes, in memory and as JSON
		n += 64 * int64(len(ls.copyCheck.Ends))
	}
	return n
}

// precheckTimeout bounds the look at storage for a commit record of a
// save's step. A slow or unreachable store must not stall a trainer's
// save: the drain checks again before it writes anything (writeShard),
// and meanwhile the save waits in the arena.
const precheckTimeout = time.Second

// precheck is the look at storage for a commit record of a save's step,
// made beside the client's copy into its region. err is set before done
// is closed: a CommittedError when the step is committed, another error
// when storage refused to say (not when it did not answer).
type precheck struct {
	done chan struct{}
	err  error
}

// startPrecheck reads the commit record of t's step on a goroutine of its
// own (the Manager's checks), bounded by precheckTimeout. It records
// whether storage answered: while it does not, CommitSave does not wait
// for the next ones (see precheckResult).
func (mgr *Manager) startPrecheck(t checkpoint.Target) *precheck {
	c := &precheck{done: make(chan struct{})}
	mgr.checks.Go(func() {
		defer close(c.done)
		ctx, cancel := context.WithTimeout(mgr.ctx, precheckTimeout)
		defer cancel()
		store, err := mgr.jobStore(t.Job)
		if err != nil {
			c.err = err
			return
		}
		// Shared with the node's other ranks saving this step at once: a
		// job's every rank asking storage at the same moment is throttled.
		rec, err := store.ReadCommitShared(ctx, t)
		switch {
		case err == nil:
			mgr.storageDown.Store(false)
			c.err = &checkpoint.CommittedError{Job: t.Job, Step: t.Step, Attempt: rec.Attempt, Mine: rec.Attempt == t.Attempt}
		case errors.Is(err, storage.ErrNotFound):
			mgr.storageDown.Store(false)
		case mgr.ctx.Err() != nil:
		case errors.Is(err, storage.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded):
			if !mgr.storageDown.Swap(true) {
				mgr.log.Warn("storage does not say whether steps are committed; saves are not held for it, and the drain checks before writing", "target", t, "err", err)
			}
		case errors.Is(err, checkpoint.ErrCorrupt):
			mgr.log.Warn("the step's commit record is unreadable; the drain will check", "target", t, "err", err)
		default:
			c.err = fmt.Errorf("check step %d: %w", t.Step, err)
		}
	})
	return c
}

// precheckResult is what the look at storage found, waiting for it
// (precheckTimeout at most) unless storage is seen down: then a save is
// not held for it, and the drain checks before writing.
func (mgr *Manager) precheckResult(c *precheck) error {
	if c == nil {
		return nil
	}
	select {
	case <-c.done:
		return c.err
	default:
	}
	if mgr.storageDown.Load() || mgr.stalled.Load() != nil {
		return nil
	}
	<-c.done
	return c.err
}

// CommitSave accepts a filled region: once it returns, the save is
// journaled in shared memory and will become durable even if the daemon
// crashes. hashes are the client's hashes of the chunks it copied, one
// per chunk of LeaseInfo.Check: required when the lease has one, else
// unused.
func (mgr *Manager) CommitSave(o Owner, id string, metadata []byte, hashes []uint64) (checkpoint.Target, int64, error) {
	if len(metadata) > MaxMetadata {
		return checkpoint.Target{}, 0, fmt.Errorf("%w: metadata is %d bytes, more than %d", checkpoint.ErrInvalid, len(metadata), MaxMetadata)
	}
	unknown := fmt.Errorf("%w: no open save lease %q (expired, aborted, or never granted to this connection)", ErrUnknownLease, id)
	mgr.mu.Lock()
	l := mgr.leases.lookup(id, o)
	if l == nil || l.kind != saveLease || l.committed {
		mgr.mu.Unlock()
		return checkpoint.Target{}, 0, unknown
	}
	check := l.check
	mgr.mu.Unlock()
	if err := mgr.precheckResult(check); err != nil {
		mgr.mu.Lock()
		if mgr.leases.lookup(id, o) == l && !l.committed {
			mgr.dropLease(l)
		}
		mgr.mu.Unlock()
		return checkpoint.Target{}, 0, err
	}
	mgr.mu.Lock()
	if mgr.leases.lookup(id, o) != l || l.committed {
		mgr.mu.Unlock()
		return checkpoint.Target{}, 0, unknown
	}
	if err := l.checkHashes(hashes); err != nil {
		mgr.mu.Unlock()
		return checkpoint.Target{}, 0, err
	}
	if err := mgr.leases.charge(l, int64(len(metadata))); err != nil {
		mgr.mu.Unlock()
		return checkpoint.Target{}, 0, err
	}
	// Marked committed before the journal write, so that nothing (abort,
	// release, the reaper, the owner going away) frees the region
	// meanwhile; the write itself runs without the lock, which every
	// other request needs.
	l.committed = true
	l.metadata = append([]byte(nil), metadata...)
	mgr.mu.Unlock()
	err := mgr.journal(l)
	if err == nil {
		mgr.arena.Seal(l.region) // the client is done: the journal holds the region now
	}
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if err != nil {
		l.committed = false
		mgr.leases.refund(l, int64(len(metadata)))
		mgr.m.failed("journal")
		return checkpoint.Target{}, 0, err
	}
	mgr.saves.set(keyOf(l.target), StateStaged, nil)
	mgr.enqueue(l)
	mgr.m.StagedBytes.Add(float64(l.layout.DataSize))
	mgr.m.SaveStall.Observe(time.Since(l.begun).Seconds())
	return l.target, l.layout.DataSize, nil
}

// checkHashes takes the client's copy check hashes for l, if it needs them.
func (l *lease) checkHashes(hashes []uint64) error {
	if l.copyCheck == nil {
		return nil
	}
	c := &checkpoint.CopyCheck{Ends: l.copyCheck.Ends, Key: l.copyCheck.Key, Hashes: hashes}
	if err := c.Validate(l.layout, true); err != nil {
		return err
	}
	l.copyCheck = c
	return nil
}

// AbortSave gives back an uncommitted save lease.
func (mgr *Manager) AbortSave(o Owner, id string) error {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	l := mgr.leases.lookup(id, o)
	if l == nil || l.kind != saveLease || l.committed {
		return fmt.Errorf("%w: no open save lease %q", ErrUnknownLease, id)
	}
	mgr.dropLease(l)
	return nil
}

// SaveFrom is the path for clients that cannot map the arena: it stages
// exactly the region's bytes read from r and commits them, so the rest of
// the pipeline is the same as for a mapped save.
func (mgr *Manager) SaveFrom(ctx context.Context, o Owner, t checkpoint.Target, tensors []checkpoint.Tensor, metadata []byte, r io.Reader) (checkpoint.Target, int64, error) {
	info, err := mgr.BeginSave(ctx, o, t, tensors)
	if err != nil {
		return checkpoint.Target{}, 0, err
	}
	region := mgr.arena.Bytes()[info.Offset : info.Offset+info.Length]
	var hashes []uint64
	if info.Check == nil {
		err = readExactly(r, region)
	} else {
		hashes, err = readHashing(r, region, tensors, info.Check)
	}
	if err != nil {
		_ = mgr.AbortSave(o, info.ID)
		return checkpoint.Target{}, 0, err
	}
	return mgr.CommitSave(o, info.ID, metadata, hashes)
}

// readExactly fills dst from r and requires r to end there.
func readExactly(r io.Reader, dst []byte) error {
	if _, err := io.ReadFull(r, dst); err != nil {
		return fmt.Errorf("%w: stream ended before the %d bytes the tensor table needs: %v", checkpoint.ErrInvalid, len(dst), err)
	}
	return readEnd(r, len(dst))
}

// readHashing is readExactly into a shared region for a save whose copy is
// checked: the daemon is the client that copies, so it hashes the stream
// on its way in (through a buffer of its own), never the shared region.
func readHashing(r io.Reader, dst []byte, tensors []checkpoint.Tensor, check *checkpoint.CopyCheck) ([]uint64, error) {
	layout, err := checkpoint.NewLayout(tensors)
	if err != nil {
		return nil, err
	}
	h := checkpoint.NewRegionHasher(layout, check)
	buf := make([]byte, min(len(dst), 1<<20))
	for off := 0; off < len(dst); {
		n, err := io.ReadFull(r, buf[:min(len(buf), len(dst)-off)])
		if err != nil {
			return nil, fmt.Errorf("%w: stream ended before the %d bytes the tensor table needs: %v", checkpoint.ErrInvalid, len(dst), err)
		}
		_, _ = h.Write(buf[:n])
		off += copy(dst[off:], buf[:n])
	}
	if err := readEnd(r, len(dst)); err != nil {
		return nil, err
	}
	return h.Sums()
}

// readEnd requires r to end after the n bytes read.
func readEnd(r io.Reader, n int) error {
	var one [1]byte
	if got, _ := r.Read(one[:]); got > 0 {
		return fmt.Errorf("%w: stream is longer than the %d bytes the tensor table needs", checkpoint.ErrInvalid, n)
	}
	return nil
}

// journalEntry is what survives a daemon crash for an accepted save.
type journalEntry struct {
	Lease    string              `json:"lease"`
	Offset   int64               `json:"offset"`
	Length   int64               `json:"length"`
	Target   checkpoint.Target   `json:"target"`
	Tensors  []checkpoint.Tensor `json:"tensors"` // region-relative
	Metadata []byte              `json:"metadata"`
	StagedAt time.Time           `json:"staged_at"`
	// Check is the client's copy check, when the daemon asked for one.
	Check *checkpoint.CopyCheck `json:"copy_check,omitempty"`
}

// journalEntry encodes l's journal entry.
func (mgr *Manager) journalEntry(l *lease) ([]byte, error) {
	return json.Marshal(journalEntry{ // the entry's id is the lease id
		Lease: l.id, Offset: l.region.Offset, Length: l.region.Length, Target: l.target,
		Tensors: l.layout.Region, Metadata: l.metadata, StagedAt: l.begun.UTC(), Check: l.copyCheck,
	})
}

// bytesOf is a staged save's bytes: its arena region, or its spilled copy.
func (mgr *Manager) bytesOf(l *lease) []byte {
	if l.unmap != nil {
		return l.spilled
	}
	return mgr.arena.Bytes()[l.region.Offset : l.region.Offset+l.size]
}

func (mgr *Manager) journal(l *lease) error {
	b, err := mgr.journalEntry(l)
	if err != nil {
		return err
	}
	if err := mgr.arena.Journal().Put(l.id, b); err != nil {
		return fmt.Errorf("journal %s: %w", l.target, err)
	}
	return nil
}

// recover re-queues the saves an earlier process accepted but did not make
// durable, reserving their regions so nothing overwrites them.
func (mgr *Manager) recover() error {
	entries, err := mgr.arena.Journal().List()
	if err != nil {
		return fmt.Errorf("read staging journal: %w", err)
	}
	recovered := make(map[string]bool, len(entries))
	for _, e := range entries {
		l, err := mgr.leaseFromEntry(e.Data, true)
		if err != nil && mgr.spill != nil && mgr.spill.has(e.ID) {
			// Its spilled copy is whole (written before the arena's entry
			// was to go): recoverSpilled replays that one.
			mgr.log.Warn("journal entry unusable, but the save is in the spill folder: replaying that copy", "entry", e.ID, "err", err)
			_ = mgr.arena.Journal().Delete(e.ID)
			continue
		}
		if err != nil {
			mgr.quarantine(e.ID, err)
			continue
		}
		recovered[e.ID] = true
		l.id = e.ID
		l.recovered = true
		if mgr.cfg.CheckCopies && l.copyCheck == nil {
			mgr.checkRecovered(l)
		}
		mgr.leases.add(l, "")
		mgr.leases.book(l) // even past the budget: it is acknowledged
		mgr.saves.setWorld(keyOf(l.target), StateStaged, nil, l.target.WorldSize)
		mgr.enqueue(l)
		mgr.log.Info("recovered staged save", "target", l.target, "bytes", l.layout.DataSize)
	}
	return mgr.recoverSpilled(recovered) // older than the arena's: they go to the front of the queue
}

// checkRecovered gives a save journaled without a copy check one, hashed
// now from the arena, before any client connects: it was staged while
// only the daemon's user could write the arena, which from this start on
// other users may, so what it holds now is what may drain.
func (mgr *Manager) checkRecovered(l *lease) {
	c := checkpoint.NewCopyCheck(mgr.w.CheckEnds(l.layout))
	h := checkpoint.NewRegionHasher(l.layout, c)
	_, _ = h.Write(mgr.bytesOf(l))
	sums, err := h.Sums()
	if err != nil { // a check without its MACs: the drain refuses the save
		mgr.log.Error("a replayed save could not be summed", "target", l.target, "err", err)
	}
	c.Hashes = sums
	l.copyCheck = c
}

// leaseFromEntry rebuilds a journaled save from its entry; reserve takes
// its region in the arena again (not for a spilled save, whose bytes are
// elsewhere).
func (mgr *Manager) leaseFromEntry(data []byte, reserve bool) (*lease, error) {
	var e journalEntry
	if err := json.Unmarshal(data, &e); err != nil {
		return nil, err
	}
	if e.Target.Attempt == "" {
		e.Target.Attempt = checkpoint.LegacyAttempt
	}
	if err := e.Target.Validate(); err != nil {
		return nil, err
	}
	if len(e.Metadata) > MaxMetadata {
		return nil, fmt.Errorf("metadata of %d bytes", len(e.Metadata))
	}
	layout, err := checkpoint.NewLayout(e.Tensors)
	if err != nil {
		return nil, err
	}
	if e.Check != nil {
		if err := e.Check.Validate(layout, true); err != nil {
			return nil, err
		}
	}
	l := &lease{
		id: e.Lease, kind: saveLease, target: e.Target, layout: layout,
		metadata: e.Metadata, committed: true, begun: e.StagedAt, copyCheck: e.Check,
	}
	l.region.Offset, l.region.Length, l.size = e.Offset, e.Length, layout.RegionSize
	if err := layout.CheckRegion(l.region.Length); err != nil {
		return nil, err
	}
	if !reserve {
		l.region = Region{}
		return l, nil
	}
	if l.region.Offset < 0 || l.region.Length < 0 || l.region.Length > mgr.arena.Size()-l.region.Offset || l.region.Offset > mgr.arena.Size() {
		return nil, fmt.Errorf("region [%d, +%d) is outside the %d-byte arena", l.region.Offset, l.region.Length, mgr.arena.Size())
	}
	if l.region.Length > 0 {
		if err := mgr.arena.Reserve(l.region); err != nil {
			return nil, err
		}
	}
	return l, nil
}

// quarantine sets aside a journal entry that no longer validates, so that
// it is never replayed again: replaying it could crash the daemon on every
// start. The entry's bytes are kept for a post-mortem.
func (mgr *Manager) quarantine(id string, why error) {
	mgr.m.Quarantined.Inc()
	if err := mgr.arena.Journal().Quarantine(id, why.Error()); err != nil {
		mgr.log.Error("journal entry unusable, and could not be set aside", "entry", id, "why", why, "err", err)
		return
	}
	mgr.log.Error("journal entry unusable; set aside in the journal's quarantine folder and not replayed", "entry", id, "why", why)
}
