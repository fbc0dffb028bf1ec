package checkpoint

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// PruneOptions say what Prune keeps.
type PruneOptions struct {
	// KeepLast is how many of the newest committed steps to keep (>= 1,
	// or >= 0 with KeepEvery).
	KeepLast int
	// KeepEvery, when positive, also keeps every committed step whose
	// number it divides (a long-term record: every 10000th step).
	KeepEvery int64
	// GCGrace is how long an attempt that is not committed is left alone
	// after its last write (default 1h): it may still be in flight.
	GCGrace time.Duration
	// DryRun reports what would be removed and removes nothing.
	DryRun bool
	// Now is the time GCGrace counts from (default time.Now()).
	Now time.Time
}

// AttemptRef names one attempt of one step.
type AttemptRef struct {
	Step    int64
	Attempt string
}

// PruneReport says what Prune removed (or, on a dry run, would remove).
type PruneReport struct {
	Kept    []int64
	Removed []int64      // committed steps removed
	Garbage []AttemptRef // attempts removed that no commit record names
	Damaged []int64      // steps with a damaged commit record or manifest: left alone
	// Pinned are committed steps kept although the policy would remove
	// them: incremental saves in flight reference them (in Kept too).
	Pinned []int64
	// Temporaries removed: what writers left mid-write, idle for GCGrace.
	Temporaries []TemporaryInfo
	Objects     int   // objects deleted
	Bytes       int64 // their size, temporaries' included
}

// Prune keeps the newest KeepLast committed steps and removes the rest.
// It also removes the attempts that no commit record names: those of
// committed steps (a crashed run's ranks) at once, and those of
// uncommitted steps once nothing was written to them for GCGrace. So are
// the temporaries that writers left mid-write (a kill -9 in a POSIX write,
// an S3 upload never completed) once idle for GCGrace. Steps whose commit
// record is damaged are left alone and reported: they need a person.
//
// An uncommitted step may still commit while Prune runs (its last ranks
// drain, or a save kept journaled through an outage drains late), so its
// commit record is read again just before its attempts are deleted.
// GCGrace is the bound on how long a step may take to commit: a save held
// back longer than that (an outage longer than the grace) can find its
// step's other ranks pruned, and then its step never commits.
//
// Deletion is reference-aware: a data object that a kept manifest points
// to (an incremental checkpoint) is kept, and so is every step an
// incremental save in flight has pinned (incremental.go). A removed
// step's COMMIT.json goes first, so a crash mid-prune leaves an
// uncommitted step, never a committed one with missing data. A prune
// deletes for at most pruneWindow (30 minutes), then stops with
// ErrPruneWindow; running it again continues.
func (s *Store) Prune(ctx context.Context, opts PruneOptions) (*PruneReport, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	if opts.GCGrace <= 0 {
		opts.GCGrace = time.Hour
	}
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	cutoff := opts.Now.Add(-opts.GCGrace)
	deadline, pinned, done, err := s.startPrune(ctx, cutoff, opts.DryRun)
	if err != nil {
		return nil, err
	}
	defer done()
	inv, err := s.Inventory(ctx)
	if err != nil {
		return nil, err
	}
	rep := &PruneReport{}
	var committed []*StepInventory
	for i := range inv {
		switch si := &inv[i]; {
		case si.Damaged != nil:
			rep.Damaged = append(rep.Damaged, si.Step)
			s.log().Warn("prune leaves a step with a damaged commit record alone", "job", s.job, "step", si.Step, "err", si.Damaged)
		case si.Commit != nil:
			committed = append(committed, si)
		}
	}
	kept, removed := opts.split(committed)
	kept, removed = keepPinned(kept, removed, pinned, rep)
	for _, si := range kept {
		rep.Kept = append(rep.Kept, si.Step)
	}
	refs, err := s.references(ctx, kept, rep)
	if err != nil {
		return nil, err
	}
	p := &pruner{s: s, refs: refs, dryRun: opts.DryRun, rep: rep, deadline: deadline}
	for _, si := range removed {
		rep.Removed = append(rep.Removed, si.Step)
		if err := p.removeStep(ctx, si); err != nil {
			return rep, err
		}
	}
	for i := range inv {
		if err := p.removeGarbage(ctx, &inv[i], cutoff); err != nil {
			return rep, err
		}
	}
	return rep, p.removeTemporaries(ctx, stepsPrefix(s.job), &cutoff)
}

// startPrune announces a prune or delete (unless dryRun) before it reads
// the pins, and returns when it must stop deleting, the steps pinned, and
// the function that ends the announcement.
func (s *Store) startPrune(ctx context.Context, cutoff time.Time, dryRun bool) (deadline time.Time, pinned map[int64]bool, done func(), err error) {
	done = func() {}
	if !dryRun {
		if done, err = s.announcePrune(ctx); err != nil {
			return time.Time{}, nil, nil, err
		}
	}
	deadline = time.Now().Add(pruneWindow)
	if pinned, err = s.pinnedSteps(ctx, cutoff, dryRun); err != nil {
		done()
		return time.Time{}, nil, nil, err
	}
	return deadline, pinned, done, nil
}

// keepPinned moves the pinned steps from removed to kept, oldest first.
func keepPinned(kept, removed []*StepInventory, pinned map[int64]bool, rep *PruneReport) (k, r []*StepInventory) {
	for _, si := range removed {
		if pinned[si.Step] {
			rep.Pinned = append(rep.Pinned, si.Step)
			k = append(k, si)
		} else {
			r = append(r, si)
		}
	}
	k = append(k, kept...)
	slices.SortFunc(k, func(a, b *StepInventory) int { return cmp.Compare(a.Step, b.Step) })
	return k, r
}

func (o PruneOptions) check() error {
	if o.KeepEvery < 0 || o.KeepLast < 0 || o.KeepLast == 0 && o.KeepEvery == 0 {
		return fmt.Errorf("%w: prune keeps the newest KeepLast steps (%d) and those KeepEvery divides (%d): "+
			"neither may be negative, and one must keep steps", ErrInvalid, o.KeepLast, o.KeepEvery)
	}
	return nil
}

// split divides the committed steps, oldest first, into those kept (the
// newest KeepLast and those KeepEvery divides) and those removed.
func (o PruneOptions) split(committed []*StepInventory) (kept, removed []*StepInventory) {
	cut := max(0, len(committed)-o.KeepLast)
	for i, si := range committed {
		if i >= cut || o.KeepEvery > 0 && si.Step%o.KeepEvery == 0 {
			kept = append(kept, si)
		} else {
			removed = append(removed, si)
		}
	}
	return kept, removed
}

// references returns the objects the kept steps' manifests point to. A
// kept step with a damaged manifest is reported in rep.Damaged and kept;
// what that manifest pointed to cannot be known, but it restores nothing
// either way.
func (s *Store) references(ctx context.Context, kept []*StepInventory, rep *PruneReport) (map[string]bool, error) {
	refs := map[string]bool{}
	for _, si := range kept {
		for rank := range si.Commit.WorldSize {
			m, err := s.Manifest(ctx, si.Commit, rank)
			if errors.Is(err, ErrCorrupt) {
				s.log().Warn("prune keeps a step with a damaged manifest; `ckptd verify` names the damage", "job", s.job, "step", si.Step, "rank", rank, "err", err)
				if !slices.Contains(rep.Damaged, si.Step) {
					rep.Damaged = append(rep.Damaged, si.Step)
				}
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("prune needs every kept manifest: %w", err)
			}
			for _, c := range m.Chunks {
				refs[inJob(s.job, c.Object)] = true
			}
		}
	}
	return refs, nil
}

type pruner struct {
	s      *Store
	refs   map[string]bool
	dryRun bool
	rep    *PruneReport
	// deadline is when deleting must stop (zero: never; DeleteJob, which
	// no incremental save can race usefully).
	deadline time.Time
}

// removeStep deletes a committed step: its commit record first, then every
// object no kept manifest references.
func (p *pruner) removeStep(ctx context.Context, si *StepInventory) error {
	commit := commitName(p.s.job, si.Step)
	if err := p.delete(ctx, storage.ObjectInfo{Name: commit}); err != nil {
		return fmt.Errorf("prune step %d: %w", si.Step, err)
	}
	for _, a := range si.Attempts {
		if err := p.deleteAll(ctx, a.objects); err != nil {
			return fmt.Errorf("prune step %d: %w", si.Step, err)
		}
	}
	return nil
}

// removeGarbage deletes the attempts of a step that its commit record does
// not name: at once for a committed step; for an uncommitted one, after
// the grace (idle since before cutoff), and only if it is still
// uncommitted now. A damaged step is left.
func (p *pruner) removeGarbage(ctx context.Context, si *StepInventory, cutoff time.Time) error {
	if si.Damaged != nil || slices.Contains(p.rep.Removed, si.Step) {
		return nil
	}
	winner, committed := si.Committed()
	if !committed {
		if !slices.ContainsFunc(si.Attempts, func(a AttemptInfo) bool { return !a.Newest.After(cutoff) }) {
			return nil // every attempt may still be in flight: no need to look again
		}
		rec, err := p.s.ReadCommit(ctx, si.Step)
		switch {
		case err == nil: // committed since the inventory: its attempt is not garbage
			winner, committed = rec.Attempt, true
		case errors.Is(err, storage.ErrNotFound):
		case errors.Is(err, ErrCorrupt):
			return nil // damaged meanwhile: left alone, as above
		default:
			return fmt.Errorf("prune step %d: %w", si.Step, err)
		}
	}
	for _, a := range si.Attempts {
		if committed && a.Attempt == winner || !committed && a.Newest.After(cutoff) {
			continue
		}
		p.rep.Garbage = append(p.rep.Garbage, AttemptRef{Step: si.Step, Attempt: a.Attempt})
		if err := p.deleteAll(ctx, a.objects); err != nil {
			return fmt.Errorf("prune step %d attempt %q: %w", si.Step, a.Attempt, err)
		}
	}
	return nil
}

// removeTemporaries deletes the temporaries under prefix that nothing was
// written to since cutoff (every one when cutoff is nil): a live writer
// keeps its own fresh, so after a grace only a dead writer's are left.
func (p *pruner) removeTemporaries(ctx context.Context, prefix string, cutoff *time.Time) error {
	temps, err := p.s.temporaries(ctx, prefix)
	if err != nil {
		return err
	}
	for _, t := range temps {
		if cutoff != nil && t.ModTime.After(*cutoff) {
			continue
		}
		if !p.dryRun {
			if err := p.s.backend.DeleteTemporary(ctx, t.Temporary); err != nil {
				return fmt.Errorf("delete the temporary %s of %s: %w", t.ID, t.Name, err)
			}
		}
		p.rep.Temporaries = append(p.rep.Temporaries, t)
		p.rep.Objects++
		p.rep.Bytes += t.Size
	}
	return nil
}

func (p *pruner) deleteAll(ctx context.Context, objs []storage.ObjectInfo) error {
	for _, oi := range objs {
		if p.refs[oi.Name] {
			continue
		}
		if err := p.delete(ctx, oi); err != nil {
			return err
		}
	}
	return nil
}

func (p *pruner) delete(ctx context.Context, oi storage.ObjectInfo) error {
	if !p.dryRun && !p.deadline.IsZero() && time.Now().After(p.deadline) {
		return fmt.Errorf("%w (%s) after %d objects: run it again to go on", ErrPruneWindow, pruneWindow, p.rep.Objects)
	}
	if !p.dryRun {
		if err := p.s.backend.Delete(ctx, oi.Name); err != nil { // a concurrent prune's delete is fine: Delete is idempotent
			return err
		}
	}
	p.rep.Objects++
	p.rep.Bytes += oi.Size
	return nil
}
