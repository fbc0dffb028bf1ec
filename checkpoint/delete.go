package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// DeleteOptions say what DeleteStep and DeleteJob may remove.
type DeleteOptions struct {
	// Force allows what a slip could cost a job its restart point: the
	// newest committed step (what --latest restores), a step not committed
	// (a save may still be writing it), a step whose commit record is
	// damaged, and a job holding committed steps.
	Force bool
	// DryRun reports what would be removed and removes nothing.
	DryRun bool
}

// ErrNeedsForce: a delete that DeleteOptions.Force must allow. Nothing
// was removed.
var ErrNeedsForce = errors.New("refused without force")

// DeleteStep removes one step: its commit record first (so that a crash
// midway leaves an uncommitted step, never a committed one with missing
// data), then every object of its attempts that no other committed step
// references, and what writers left of it mid-write. The report's Removed
// names the step; Damaged, other steps whose manifests could not be read
// (what they reference cannot be known, so they are no protection).
func (s *Store) DeleteStep(ctx context.Context, step int64, opts DeleteOptions) (*PruneReport, error) {
	if err := validateStep(step); err != nil {
		return nil, err
	}
	// Announced, and the pins read, before the commit records: see
	// incremental.go.
	deadline, pinned, done, err := s.startPrune(ctx, time.Now().Add(-inFlight), opts.DryRun)
	if err != nil {
		return nil, err
	}
	defer done()
	inv, err := s.Inventory(ctx)
	if err != nil {
		return nil, err
	}
	i := slices.IndexFunc(inv, func(si StepInventory) bool { return si.Step == step })
	if i < 0 {
		return nil, fmt.Errorf("%w: job %q has no step %d in %s", ErrStepNotFound, s.job, step, s.backend.Location())
	}
	target := &inv[i]
	if pinned[step] {
		return nil, fmt.Errorf("%w: step %d; try again once the saves of the steps after it have committed", ErrPinned, step)
	}
	var others []*StepInventory
	for j := range inv {
		if j != i && inv[j].Commit != nil {
			others = append(others, &inv[j])
		}
	}
	if err := s.mayDelete(target, others, opts.Force); err != nil {
		return nil, err
	}
	rep := &PruneReport{}
	refs, err := s.references(ctx, others, rep)
	if err != nil {
		return nil, err
	}
	p := &pruner{s: s, refs: refs, dryRun: opts.DryRun, rep: rep, deadline: deadline}
	rep.Removed = []int64{step}
	if err := p.removeStep(ctx, target); err != nil {
		return rep, err
	}
	return rep, p.removeTemporaries(ctx, stepDir(s.job, step), nil)
}

// mayDelete refuses, unless forced, a step whose loss a slip could cost.
func (s *Store) mayDelete(si *StepInventory, others []*StepInventory, force bool) error {
	if force {
		return nil
	}
	switch {
	case si.Damaged != nil:
		return fmt.Errorf("%w: step %d's commit record is damaged (%v); `ckptd verify` names the damage",
			ErrNeedsForce, si.Step, si.Damaged)
	case si.Commit == nil:
		return fmt.Errorf("%w: step %d is not committed, so a save may still be writing it; `ckptd prune` removes it once "+
			"nothing was written to it for its grace", ErrNeedsForce, si.Step)
	case !slices.ContainsFunc(others, func(o *StepInventory) bool { return o.Step > si.Step }):
		return fmt.Errorf("%w: step %d is job %q's newest committed step, which a restart of the job restores "+
			"(after it is deleted, latest is the step before)", ErrNeedsForce, si.Step, s.job)
	}
	return nil
}

// inFlight is how recent a write must be for DeleteJob to take its step
// for one a save may still be writing: prune's default grace.
const inFlight = time.Hour

// DeleteJob removes every object of the job: its commit records first,
// then everything else, then what writers left mid-write. A job holding a
// committed step, or an object written within inFlight (a save may still
// be writing it), needs opts.Force.
func (s *Store) DeleteJob(ctx context.Context, opts DeleteOptions) (*PruneReport, error) {
	rep := &PruneReport{}
	var commits, rest []storage.ObjectInfo
	err := s.backend.List(ctx, s.job+"/", func(oi storage.ObjectInfo) error {
		if strings.HasSuffix(oi.Name, "/"+commitFile) {
			commits = append(commits, oi)
			if step, _ := s.placeOf(oi.Name); step >= 0 {
				rep.Removed = append(rep.Removed, step)
			}
		} else {
			rest = append(rest, oi)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list job %q: %w", s.job, err)
	}
	switch {
	case opts.Force:
	case len(commits) > 0:
		return nil, fmt.Errorf("%w: job %q holds %d committed steps, the newest of which a restart of the job restores",
			ErrNeedsForce, s.job, len(commits))
	case slices.ContainsFunc(rest, func(oi storage.ObjectInfo) bool { return time.Since(oi.ModTime) < inFlight }):
		return nil, fmt.Errorf("%w: job %q has objects written within the last %s: a save may still be writing them",
			ErrNeedsForce, s.job, inFlight)
	}
	p := &pruner{s: s, dryRun: opts.DryRun, rep: rep}
	if err := p.deleteAll(ctx, commits); err != nil {
		return rep, err
	}
	if err := p.deleteAll(ctx, rest); err != nil {
		return rep, err
	}
	return rep, p.removeTemporaries(ctx, s.job+"/", nil)
}
