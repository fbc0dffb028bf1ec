package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/storage"
)

// Store reads one job's checkpoints. It is what `ckptd list`, `verify`,
// `restore` and `prune` use directly, with no daemon running.
type Store struct {
	B   storage.Backend
	Job string
}

// NewStore checks the job name and returns a Store for it.
func NewStore(b storage.Backend, job string) (*Store, error) {
	if err := ValidateName("job", job); err != nil {
		return nil, err
	}
	return &Store{B: b, Job: job}, nil
}

// metaConcurrency bounds the small metadata requests (a Stat or a GET of
// COMMIT.json per step) that listing a job's steps makes at once: enough to
// hide an object store's latency, few enough not to be throttled.
const metaConcurrency = 16

// Steps returns the commit records of all committed steps, oldest first.
// It costs one directory listing of the job's steps plus one small read
// per step, whatever the number of ranks and chunks.
func (s *Store) Steps(ctx context.Context) ([]*CommitRecord, error) {
	steps, err := s.allSteps(ctx)
	if err != nil {
		return nil, err
	}
	return s.commitRecords(ctx, steps)
}

// commitRecords reads the commit records of those of steps that have one,
// metaConcurrency at a time, in the order of steps.
func (s *Store) commitRecords(ctx context.Context, steps []int64) ([]*CommitRecord, error) {
	recs := make([]*CommitRecord, len(steps))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(metaConcurrency)
	for i, step := range steps {
		g.Go(func() error {
			rec, err := s.readCommit(gctx, step)
			if errors.Is(err, storage.ErrNotFound) {
				return nil // in flight, or left by a crash
			}
			recs[i] = rec
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return slices.DeleteFunc(recs, func(r *CommitRecord) bool { return r == nil }), nil
}

// allSteps lists the steps that have any object, ascending, from the
// directories under the job's steps/ (the objects in them are not read).
func (s *Store) allSteps(ctx context.Context) ([]int64, error) {
	var steps []int64
	err := s.B.ListDirs(ctx, stepsPrefix(s.Job), func(seg string) error {
		if step, err := strconv.ParseInt(seg, 10, 64); err == nil && step >= 0 && stepSegment(step) == seg {
			steps = append(steps, step)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list steps of job %q in %s: %w", s.Job, s.B.Location(), err)
	}
	slices.Sort(steps)
	return steps, nil
}

// Latest returns the newest committed step, or ErrStepNotFound. It checks
// steps newest first, so it usually costs one listing and one Stat.
func (s *Store) Latest(ctx context.Context) (int64, error) {
	steps, err := s.allSteps(ctx)
	if err != nil {
		return 0, err
	}
	for _, step := range slices.Backward(steps) {
		ok, err := s.Committed(ctx, step)
		if err != nil {
			return 0, fmt.Errorf("latest step of job %q in %s: %w", s.Job, s.B.Location(), err)
		}
		if ok {
			return step, nil
		}
	}
	return 0, fmt.Errorf("%w: job %q has no committed steps in %s", ErrStepNotFound, s.Job, s.B.Location())
}

// Resolve returns the commit record of step, or of the newest committed
// step when latest is set. An unknown step's error names the latest one.
func (s *Store) Resolve(ctx context.Context, step int64, latest bool) (*CommitRecord, error) {
	if latest {
		var err error
		if step, err = s.Latest(ctx); err != nil {
			return nil, err
		}
	} else if err := validateStep(step); err != nil {
		return nil, err
	}
	rec, err := s.readCommit(ctx, step)
	if errors.Is(err, storage.ErrNotFound) {
		return nil, s.notFound(ctx, step)
	}
	return rec, err
}

func (s *Store) notFound(ctx context.Context, step int64) error {
	latest, err := s.Latest(ctx)
	if err != nil {
		return fmt.Errorf("%w: step %d of job %q is not committed, and the job has no committed steps in %s",
			ErrStepNotFound, step, s.Job, s.B.Location())
	}
	return fmt.Errorf("%w: step %d of job %q is not committed (latest committed step: %d)", ErrStepNotFound, step, s.Job, latest)
}

// Committed reports whether step has a commit record.
func (s *Store) Committed(ctx context.Context, step int64) (bool, error) {
	_, err := s.B.Stat(ctx, commitName(s.Job, step))
	if errors.Is(err, storage.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

func (s *Store) readCommit(ctx context.Context, step int64) (*CommitRecord, error) {
	name := commitName(s.Job, step)
	data, err := readObject(ctx, s.B, name, 1<<20)
	if err != nil {
		return nil, err
	}
	rec, err := ParseCommit(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if rec.Step != step || rec.Job != s.Job {
		return nil, fmt.Errorf("%w: %s describes job %q step %d", ErrCorrupt, name, rec.Job, rec.Step)
	}
	return rec, nil
}

// Manifest reads and validates one rank's manifest of a committed step.
func (s *Store) Manifest(ctx context.Context, rec *CommitRecord, rank int) (*Manifest, error) {
	if rank < 0 || rank >= rec.WorldSize {
		return nil, fmt.Errorf("%w: rank %d out of range: step %d has world size %d", ErrInvalid, rank, rec.Step, rec.WorldSize)
	}
	m, err := readManifest(ctx, s.B, manifestName(s.Job, rec.Step, rank))
	if err != nil {
		return nil, fmt.Errorf("step %d rank %d: %w", rec.Step, rank, err)
	}
	if m.Target() != (Target{Job: s.Job, Step: rec.Step, Rank: rank, WorldSize: rec.WorldSize}) {
		return nil, fmt.Errorf("%w: manifest of step %d rank %d describes %s", ErrCorrupt, rec.Step, rank, m.Target())
	}
	return m, nil
}
