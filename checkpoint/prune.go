package checkpoint

import (
	"context"
	"fmt"

	"github.com/ckptd/ckptd/storage"
)

// PruneReport says what Prune removed (or, on a dry run, would remove).
type PruneReport struct {
	Kept    []int64
	Removed []int64 // committed steps removed
	Partial []int64 // uncommitted leftovers older than every kept step
	Objects int     // objects deleted
	Bytes   int64   // their size
}

// Prune keeps the newest keepLast committed steps and removes the rest,
// plus uncommitted steps older than the oldest kept one (left by crashes;
// newer uncommitted steps may still be in flight and are left alone).
//
// Deletion is reference-aware: a data object that a kept manifest points
// to (an incremental checkpoint) is kept. A removed step's COMMIT.json goes
// first, so a crash mid-prune leaves an uncommitted step, never a committed
// one with missing data.
func (s *Store) Prune(ctx context.Context, keepLast int, dryRun bool) (*PruneReport, error) {
	if keepLast < 1 {
		return nil, fmt.Errorf("%w: --keep-last must be at least 1, got %d", ErrInvalid, keepLast)
	}
	all, err := s.allSteps(ctx)
	if err != nil {
		return nil, err
	}
	recs, err := s.commitRecords(ctx, all)
	if err != nil {
		return nil, err
	}
	committed := make([]int64, len(recs))
	for i, rec := range recs {
		committed[i] = rec.Step
	}
	rep := &PruneReport{}
	if len(committed) <= keepLast {
		rep.Kept = committed
		return rep, nil
	}
	cut := len(committed) - keepLast
	rep.Kept, rep.Removed = committed[cut:], committed[:cut]
	oldestKept := rep.Kept[0]
	isCommitted := map[int64]bool{}
	for _, st := range committed {
		isCommitted[st] = true
	}
	for _, st := range all {
		if st < oldestKept && !isCommitted[st] {
			rep.Partial = append(rep.Partial, st)
		}
	}
	refs, err := s.references(ctx, rep.Kept)
	if err != nil {
		return nil, err
	}
	for _, st := range append(append([]int64{}, rep.Removed...), rep.Partial...) {
		if err := s.removeStep(ctx, st, refs, dryRun, rep); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// references returns the objects the kept steps' manifests point to.
func (s *Store) references(ctx context.Context, kept []int64) (map[string]bool, error) {
	refs := map[string]bool{}
	for _, st := range kept {
		rec, err := s.readCommit(ctx, st)
		if err != nil {
			return nil, err
		}
		for rank := range rec.WorldSize {
			m, err := s.Manifest(ctx, rec, rank)
			if err != nil {
				return nil, fmt.Errorf("prune needs every kept manifest: %w", err)
			}
			for _, c := range m.Chunks {
				refs[inJob(s.Job, c.Object)] = true
			}
		}
	}
	return refs, nil
}

// removeStep deletes a step's objects, the commit record first and
// referenced data never.
func (s *Store) removeStep(ctx context.Context, step int64, refs map[string]bool, dryRun bool, rep *PruneReport) error {
	var objs []storage.ObjectInfo
	commit := commitName(s.Job, step)
	err := s.B.List(ctx, stepDir(s.Job, step), func(oi storage.ObjectInfo) error {
		if refs[oi.Name] {
			return nil
		}
		if oi.Name == commit {
			objs = append([]storage.ObjectInfo{oi}, objs...)
		} else {
			objs = append(objs, oi)
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, oi := range objs {
		if !dryRun {
			if err := s.B.Delete(ctx, oi.Name); err != nil { // a concurrent prune's delete is fine: Delete is idempotent
				return fmt.Errorf("prune step %d: %w", step, err)
			}
		}
		rep.Objects++
		rep.Bytes += oi.Size
	}
	return nil
}
