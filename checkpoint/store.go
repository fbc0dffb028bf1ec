package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

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

// Steps returns the commit records of all committed steps, oldest first.
func (s *Store) Steps(ctx context.Context) ([]*CommitRecord, error) {
	steps, err := s.stepNumbers(ctx, true)
	if err != nil {
		return nil, err
	}
	recs := make([]*CommitRecord, 0, len(steps))
	for _, step := range steps {
		rec, err := s.readCommit(ctx, step)
		if err != nil {
			return nil, err
		}
		recs = append(recs, rec)
	}
	return recs, nil
}

// stepNumbers lists the steps that have any object (committedOnly: a
// COMMIT.json), ascending.
func (s *Store) stepNumbers(ctx context.Context, committedOnly bool) ([]int64, error) {
	prefix := stepsPrefix(s.Job)
	set := map[int64]bool{}
	err := s.B.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		dir, file, ok := strings.Cut(strings.TrimPrefix(oi.Name, prefix), "/")
		if !ok || (committedOnly && file != commitFile) {
			return nil
		}
		if step, err := strconv.ParseInt(dir, 10, 64); err == nil && len(dir) == 12 {
			set[step] = true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list steps of job %q in %s: %w", s.Job, s.B.Location(), err)
	}
	steps := make([]int64, 0, len(set))
	for step := range set {
		steps = append(steps, step)
	}
	sort.Slice(steps, func(i, j int) bool { return steps[i] < steps[j] })
	return steps, nil
}

// Latest returns the newest committed step, or ErrStepNotFound.
func (s *Store) Latest(ctx context.Context) (int64, error) {
	steps, err := s.stepNumbers(ctx, true)
	if err != nil {
		return 0, err
	}
	if len(steps) == 0 {
		return 0, fmt.Errorf("%w: job %q has no committed steps in %s", ErrStepNotFound, s.Job, s.B.Location())
	}
	return steps[len(steps)-1], nil
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
