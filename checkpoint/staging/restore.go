package staging

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/storage"
)

// RestoreHeader describes a restored shard.
type RestoreHeader struct {
	Step      int64
	WorldSize int
	Attempt   string              // "" for a step written before attempts existed
	Tensors   []checkpoint.Tensor // offsets relative to the region
	Metadata  []byte
	Size      int64
	// Tier is where the bytes came from: "hot" (this node's memory),
	// "peer" (another sidecar's replica) or "storage".
	Tier string
	// SkippedStep, for latest, is a newer step kept in memory only whose
	// ranks are no longer all held anywhere (their nodes were lost), so
	// that this older step was restored instead; 0 when none.
	SkippedStep int64
	// SkippedNonFinite, for Finite, are the newer committed steps passed
	// over for holding NaN or Inf, newest first.
	SkippedNonFinite []int64
	// Check, when the Manager checks copies (its arena is shared with
	// other users), is what the restored bytes, whole chunks, hash to
	// (MACs under a key of this restore's), for the client to check its
	// copy against.
	Check *checkpoint.CopyCheck
	// InPlace: the region is the hot copy in place (RestoreRequest.
	// InPlace), Size the span of the data space holding the tensors.
	InPlace bool
}

// RestoreRequest names what BeginRestore restores.
type RestoreRequest struct {
	Job    string // "" for the default job
	Step   int64  // ignored when Latest
	Latest bool
	Rank   int
	// Tensors, when not empty, restores only these tensors of the shard,
	// back to back in this order (only their chunks are read): a reader
	// that needs a few tensors of a large shard.
	Tensors []string
	// Slices, when not empty (Tensors empty), restores only these byte
	// ranges of the shard's tensors, back to back in this order (only the
	// chunks holding them are read): a resharding reader's part of a
	// tensor.
	Slices []checkpoint.Slice
	// HeaderOnly restores no tensor, and reads none: the header alone,
	// for the step's metadata.
	HeaderOnly bool
	// InPlace says the client maps the hot mapping (ManagerConfig.
	// HotMapping): a restore from the hot tier may then hand out the hot
	// copy's bytes there (the lease's ArenaID names the mapping), the
	// selected ones where they lie in the shard's data space, with the
	// bytes between them.
	InPlace bool
	// Finite, with Latest, restores the newest committed step whose
	// tensors hold no NaN or Inf, as the drain counted them. Steps kept in
	// memory only are not considered: their health is known rank by rank,
	// on the nodes that hold them, not job-wide.
	Finite bool
}

// BeginRestore fills a region of the arena with one rank's shard of a
// committed step (the newest when latest is set), or the tensors of it
// the request names, every chunk verified. The caller reads the region
// and then calls Release; the region is freed too when owner goes away.
func (mgr *Manager) BeginRestore(ctx context.Context, o Owner, req RestoreRequest) (LeaseInfo, *RestoreHeader, error) {
	job, step, latest, rank := req.Job, req.Step, req.Latest, req.Rank
	store, err := mgr.jobStore(job)
	if err != nil {
		return LeaseInfo{}, nil, err
	}
	select { // bounds the memory restores hold: see ManagerConfig.Restores
	case mgr.restores <- struct{}{}:
		defer func() { <-mgr.restores }()
	case <-ctx.Done():
		return LeaseInfo{}, nil, budget.Wrap(fmt.Errorf("waiting for one of the %d restores allowed at once: %w", cap(mgr.restores), ctx.Err()), budget.Restores)
	}
	var skippedNonFinite []int64
	if req.Finite {
		if !latest {
			return LeaseInfo{}, nil, fmt.Errorf("%w: finite picks among steps for latest; give latest, not a step", checkpoint.ErrInvalid)
		}
		rec, skipped, err := store.LatestFinite(ctx)
		if err != nil {
			return LeaseInfo{}, nil, err
		}
		step, latest, skippedNonFinite = rec.Step, false, skipped
	}
	src, err := mgr.restoreSource(ctx, store, step, latest, rank)
	if err != nil {
		return LeaseInfo{}, nil, err
	}
	defer func() { src.Release() }() // unless a lease in place took its pin
	m := src.M
	sel, err := selection(m, req)
	if err != nil {
		return LeaseInfo{}, nil, err
	}
	var check *checkpoint.CopyCheck
	if mgr.cfg.CheckCopies {
		sel, check = sel.Checked(m)
	}
	mgr.mu.Lock()
	closing := mgr.closing
	mgr.mu.Unlock()
	if closing {
		return LeaseInfo{}, nil, ErrClosing
	}
	var l *lease
	if req.InPlace && check == nil && sel.Size > 0 { // a header alone needs no mapping nor pin
		l, sel, err = mgr.inPlaceLease(&src, sel)
	}
	if l == nil && err == nil {
		l, err = mgr.copiedLease(ctx, src, store, sel, check)
	}
	if err != nil {
		return LeaseInfo{}, nil, err
	}
	mgr.m.Restored.Add(float64(sel.Size))
	mgr.m.RestoreTiers.WithLabelValues(src.Tier).Inc()
	info, inPlace := l.info(), l.inPlace != nil // before another goroutine may end it
	mgr.mu.Lock()
	// Each restore lease books a fixed cost of the table budget: one
	// of a tensor-less (zero-byte) step takes no arena space, so nothing
	// else would bound how many a client holds.
	err = mgr.leases.charge(l, restoreLeaseCost)
	if err == nil {
		err = mgr.addLease(l, o)
	} else {
		mgr.letGo(l)
	}
	mgr.mu.Unlock()
	if err != nil {
		return LeaseInfo{}, nil, err
	}
	if inPlace {
		mgr.m.RestoredInPlace.Add(float64(sel.Size))
	}
	h := &RestoreHeader{Step: m.Step, WorldSize: m.WorldSize, Attempt: m.Attempt, Tensors: sel.Table, Metadata: m.Metadata, Size: sel.Size,
		Tier: src.Tier, SkippedStep: src.Skipped, SkippedNonFinite: skippedNonFinite, Check: check, InPlace: inPlace}
	return info, h, nil
}

// copiedLease is a restore lease of a region of the arena filled with sel
// of src.
func (mgr *Manager) copiedLease(ctx context.Context, src tiers.Source, store *checkpoint.Store, sel checkpoint.Selection, check *checkpoint.CopyCheck) (*lease, error) {
	region, err := mgr.alloc(ctx, sel.Size)
	if err != nil {
		return nil, fmt.Errorf("restore step %d rank %d: %w", src.M.Step, src.M.Rank, err)
	}
	if err := mgr.fill(ctx, src, store, sel, region, check); err != nil {
		mgr.m.failed("restore")
		mgr.mu.Lock()
		mgr.freeRegion(region)
		mgr.mu.Unlock()
		return nil, err
	}
	return &lease{
		id: newLeaseID(), kind: restoreLease, region: region, size: sel.Size,
		begun: time.Now(), expires: time.Now().Add(mgr.cfg.LeaseTimeout),
	}, nil
}

// inPlaceLease is a restore lease of src's hot copy where it lies in the
// hot mapping, the span of it sel needs verified first, with the pin that
// keeps it (sel as the lease hands it out: its table's offsets into the
// span); nil when src is not a hot copy in the mapping.
func (mgr *Manager) inPlaceLease(src *tiers.Source, sel checkpoint.Selection) (*lease, checkpoint.Selection, error) {
	hm, data := mgr.cfg.HotMapping, src.Hot()
	if hm == nil || data == nil {
		return nil, sel, nil
	}
	base, ok := hm.Offset(data)
	if !ok {
		return nil, sel, nil
	}
	if err := src.M.VerifySelected(data, sel, "hot copy"); err != nil {
		mgr.m.failed("restore")
		return nil, sel, err
	}
	lo, size, table := sel.InPlace(src.M)
	sel.Table, sel.Size = table, size
	return &lease{
		id: newLeaseID(), kind: restoreLease, size: size,
		inPlace: &inPlaceRead{arenaID: hm.ID(), offset: base + lo, data: data[lo : lo+size], unpin: src.TakePin()},
		begun:   time.Now(), expires: time.Now().Add(mgr.cfg.LeaseTimeout),
	}, sel, nil
}

// fill restores sel of src into region. A selection of no bytes reads
// nothing (a peer's copy would be fetched whole to select nothing).
//
// With a check it fills a buffer of the daemon's own, takes its MACs
// (check.Hashes) and only then copies it into the region, which others
// can write: the client checks its copy against MACs of bytes no one else
// could touch. The buffer is the restore's size, on the heap, for as long
// as the fill (at most ManagerConfig.Restores at once).
func (mgr *Manager) fill(ctx context.Context, src tiers.Source, store *checkpoint.Store, sel checkpoint.Selection, region Region, check *checkpoint.CopyCheck) error {
	if !sel.Whole && sel.Size == 0 {
		return nil
	}
	dst := mgr.arena.Bytes()[region.Offset : region.Offset+sel.Size]
	if check == nil {
		return src.Fill(ctx, store, sel, dst, mgr.cfg.Read)
	}
	own := make([]byte, sel.Size)
	if err := src.Fill(ctx, store, sel, own, mgr.cfg.Read); err != nil {
		return err
	}
	sums, err := checkpoint.Sums(check.Key, check.Ends, own)
	if err != nil {
		return err
	}
	check.Hashes = sums
	copy(dst, own)
	return nil
}

// selection is what of m req restores: the whole shard, some tensors,
// slices of them, or nothing.
func selection(m *checkpoint.Manifest, req RestoreRequest) (checkpoint.Selection, error) {
	switch n := len(req.Tensors); {
	case req.HeaderOnly && (n > 0 || len(req.Slices) > 0):
		return checkpoint.Selection{}, fmt.Errorf("%w: a header-only restore names no tensors and no slices", checkpoint.ErrInvalid)
	case req.HeaderOnly:
		return checkpoint.Selection{}, nil
	case n > 0 && len(req.Slices) > 0:
		return checkpoint.Selection{}, fmt.Errorf("%w: a restore names tensors or slices of them, not both", checkpoint.ErrInvalid)
	case len(req.Slices) > 0:
		return checkpoint.SelectSlices(m, req.Slices)
	}
	return checkpoint.SelectTensors(m, req.Tensors)
}

// restoreLeaseCost is what a restore lease books of the table budget: the
// lease and its place in the lease table, rounded up.
const restoreLeaseCost = 1 << 10

// restoreSource resolves the step and finds rank's shard: in the hot tier
// when it holds the committed attempt's copy (no storage read but the
// commit record's), else at a peer, else in storage. A step kept in memory
// only (the persistence policy) is found through the sidecars' inventories, and
// is latest when it is newer than every committed step and whole. When
// storage does not answer, the hot tier's copy of the step (or, for
// latest, of its newest committed step) is served alone.
func (mgr *Manager) restoreSource(ctx context.Context, store *checkpoint.Store, step int64, latest bool, rank int) (tiers.Source, error) {
	rec, err := store.Resolve(ctx, step, latest)
	var skipped int64
	if mgr.tiers.MemoryTier() && (latest || rec == nil) && (err == nil || errors.Is(err, checkpoint.ErrStepNotFound) || errors.Is(err, storage.ErrUnavailable)) {
		committed := int64(-1)
		if rec != nil {
			committed = rec.Step
		} else if s, ok := mgr.tiers.Latest(store.Job(), rank); ok && latest { // storage is down: what is known committed
			committed = s
		}
		src, found, merr := mgr.tiers.FromMemory(ctx, store.Job(), step, latest, committed, rank)
		if found || merr != nil {
			return src, merr
		}
		if skipped = src.Skipped; skipped > 0 && !latest {
			return tiers.Source{}, budget.Wrap(fmt.Errorf("%w: step %d of job %q was kept in memory only (the persistence policy) and some of its ranks are held by no sidecar now "+
				"(or only by sidecars that list differing copies of them: the log names them); restore a persisted step (ckptd list)", checkpoint.ErrStepNotFound, step, store.Job()), budget.PersistPolicy)
		}
		if skipped > 0 {
			mgr.log.Warn("a newer step was kept in memory only and some of its ranks are held nowhere now; restoring the last persisted step",
				"job", store.Job(), "skipped_step", skipped, "rank", rank)
		}
	}
	src, err := mgr.persistedSource(ctx, store, rec, err, step, latest, rank)
	src.Skipped = skipped
	return src, err
}

// persistedSource finds rank's shard of a step persisted in storage, rec
// and err being what resolving it said.
func (mgr *Manager) persistedSource(ctx context.Context, store *checkpoint.Store, rec *checkpoint.CommitRecord, err error, step int64, latest bool, rank int) (tiers.Source, error) {
	if errors.Is(err, storage.ErrUnavailable) {
		found := !latest
		if latest {
			step, found = mgr.tiers.Latest(store.Job(), rank)
		}
		if found {
			if src, ok := mgr.tiers.CommittedCopy(ctx, store.Job(), step, rank); ok {
				mgr.log.Warn("storage does not answer; restoring from the "+src.Tier+" tier", "job", store.Job(), "step", step, "rank", rank, "err", err)
				return src, nil
			}
		}
	}
	if err != nil {
		return tiers.Source{}, err
	}
	mgr.tiers.MarkCommitted(store.Job(), rec) // the commit may have been another node's
	if rank >= 0 && rank < rec.WorldSize {
		if src, ok := mgr.tiers.Hot(store.Job(), rec.Step, rank, rec.Attempt); ok {
			if src.PinnedBy(rec, rank) {
				return src, nil
			}
			src.Release()
			mgr.log.Warn("the hot copy is not the manifest the step committed; reading storage", "job", store.Job(), "step", rec.Step, "rank", rank)
		}
		if src, ok := mgr.tiers.FromPeers(ctx, store.Job(), rec.Step, rank, rec.Attempt, nil); ok {
			if src.PinnedBy(rec, rank) {
				return src, nil
			}
			src.Release()
			mgr.log.Warn("a peer's replica is not the manifest the step committed; reading storage", "job", store.Job(), "step", rec.Step, "rank", rank)
		}
	}
	m, err := store.Manifest(ctx, rec, rank)
	if latest && errors.Is(err, checkpoint.ErrCorrupt) {
		return tiers.Source{}, fmt.Errorf("%w; latest does not fall back to an earlier step for one rank, whose other ranks would restore this one: "+
			"load an earlier step by number (ckptd list), or restore with ckptd restore --latest, which skips a damaged step for all ranks", err)
	}
	if err != nil {
		return tiers.Source{}, err
	}
	return tiers.StorageSource(m), nil
}

// Release returns a restore region, or an uncommitted save region, to the
// arena.
func (mgr *Manager) Release(o Owner, id string) error {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	l := mgr.leases.lookup(id, o)
	if l == nil || l.committed {
		return fmt.Errorf("%w: no releasable lease %q", ErrUnknownLease, id)
	}
	mgr.dropLease(l)
	return nil
}

// Bytes returns a lease's bytes in the daemon's mapping (for streaming
// restores to clients that cannot map the arena).
func (mgr *Manager) Bytes(o Owner, id string) ([]byte, error) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	l := mgr.leases.lookup(id, o)
	if l == nil {
		return nil, fmt.Errorf("%w: %q", ErrUnknownLease, id)
	}
	if l.inPlace != nil {
		return l.inPlace.data, nil
	}
	return mgr.arena.Bytes()[l.region.Offset : l.region.Offset+l.size], nil
}

// Steps lists the committed steps of job, oldest first.
func (mgr *Manager) Steps(ctx context.Context, job string) ([]*checkpoint.CommitRecord, error) {
	store, err := mgr.jobStore(job)
	if err != nil {
		return nil, err
	}
	return store.Steps(ctx)
}
