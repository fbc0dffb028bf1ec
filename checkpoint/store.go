package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/storage"
)

// Store reads and commits one job's checkpoints. The Manager commits
// steps through it (TryCommit); `ckptd list`, `verify`, `restore` and
// `prune` use it directly, with no daemon running.
type Store struct {
	backend storage.Backend
	job     string
	// logger receives warnings about damaged steps that listing skips
	// (default slog.Default()).
	logger *slog.Logger
}

// NewStore checks the job name and returns a Store for it.
func NewStore(b storage.Backend, job string) (*Store, error) {
	if err := ValidateName("job", job); err != nil {
		return nil, err
	}
	return &Store{backend: b, job: job}, nil
}

// WithLogger is s logging the damaged steps it skips to l.
func (s *Store) WithLogger(l *slog.Logger) *Store {
	c := *s
	c.logger = l
	return &c
}

// Job is the job s reads and commits.
func (s *Store) Job() string { return s.job }

func (s *Store) log() *slog.Logger {
	if s.logger != nil {
		return s.logger
	}
	return slog.Default()
}

// skipDamaged reports whether err means step's commit record is damaged
// (unparseable, truncated, of another step), which listing skips with a
// warning: one bad record must not hide every other step of the job.
func (s *Store) skipDamaged(step int64, err error) bool {
	if !errors.Is(err, ErrCorrupt) {
		return false
	}
	s.log().Warn("skipping a step whose commit record or a manifest is damaged; `ckptd verify` and `ckptd prune` name it too",
		"job", s.job, "step", step, "err", err)
	return true
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
			rec, err := s.ReadCommit(gctx, step)
			if errors.Is(err, storage.ErrNotFound) || s.skipDamaged(step, err) {
				return nil // in flight, left by a crash, or damaged
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
	err := s.backend.ListDirs(ctx, stepsPrefix(s.job), func(seg string) error {
		if step, ok := parseStepSegment(seg); ok {
			steps = append(steps, step)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list steps of job %q in %s: %w", s.job, s.backend.Location(), err)
	}
	slices.Sort(steps)
	return steps, nil
}

// Latest returns the newest committed step whose commit record is
// readable, or ErrStepNotFound. It checks steps newest first, so it
// usually costs one listing and one small read; a damaged record is
// skipped with a warning and the next older step is used.
func (s *Store) Latest(ctx context.Context) (int64, error) {
	rec, err := s.latest(ctx)
	if err != nil {
		return 0, err
	}
	return rec.Step, nil
}

func (s *Store) latest(ctx context.Context) (*CommitRecord, error) {
	return s.latestWhere(ctx, nil)
}

// latestWhere is the newest committed step whose commit record reads, and
// for which check (if any) finds no damage (ErrCorrupt): a step it finds
// damaged is skipped as one with a damaged commit record is.
func (s *Store) latestWhere(ctx context.Context, check func(*CommitRecord) error) (*CommitRecord, error) {
	steps, err := s.allSteps(ctx)
	if err != nil {
		return nil, err
	}
	for _, step := range slices.Backward(steps) {
		rec, err := s.ReadCommit(ctx, step)
		if err == nil && check != nil {
			err = check(rec)
		}
		switch {
		case err == nil:
			return rec, nil
		case errors.Is(err, storage.ErrNotFound), errors.Is(err, errPassOver), s.skipDamaged(step, err):
		default:
			return nil, fmt.Errorf("latest step of job %q in %s: %w", s.job, s.backend.Location(), err)
		}
	}
	return nil, fmt.Errorf("%w: job %q has no committed steps in %s", ErrStepNotFound, s.job, s.backend.Location())
}

// Resolve returns the commit record of step, or of the newest committed
// step when latest is set. An unknown step's error names the latest one.
func (s *Store) Resolve(ctx context.Context, step int64, latest bool) (*CommitRecord, error) {
	if latest {
		return s.latest(ctx)
	}
	if err := validateStep(step); err != nil {
		return nil, err
	}
	rec, err := s.ReadCommit(ctx, step)
	if errors.Is(err, storage.ErrNotFound) {
		return nil, s.notFound(ctx, step)
	}
	return rec, err
}

// ResolveWhole is Resolve for a reader of every rank (ckptd restore and
// export): with latest, the newest committed step whose commit record and
// every rank's manifest read and check (metaConcurrency at a time), a
// step with a damaged manifest being skipped with a warning naming it. A
// trainer loading its own rank does not fall back so (see
// Manager.BeginRestore): its ranks could then restore different steps.
// The manifests are not kept: a caller restoring one rank needs one.
func (s *Store) ResolveWhole(ctx context.Context, step int64, latest bool) (*CommitRecord, error) {
	if !latest {
		return s.Resolve(ctx, step, false)
	}
	return s.latestWhere(ctx, s.wholeCheck(ctx))
}

// wholeCheck reads every rank's manifest of a step (metaConcurrency at a
// time): an error says one is missing or damaged.
func (s *Store) wholeCheck(ctx context.Context) func(*CommitRecord) error {
	return func(rec *CommitRecord) error {
		g, gctx := errgroup.WithContext(ctx)
		g.SetLimit(metaConcurrency)
		for rank := range rec.WorldSize {
			g.Go(func() error {
				_, err := s.Manifest(gctx, rec, rank)
				return err
			})
		}
		return g.Wait()
	}
}

// errPassOver, from a latestWhere check, passes over a step that is fine
// but not wanted.
var errPassOver = errors.New("passed over")

// LatestWholeFinite is ResolveWhole's latest for a run that may have
// diverged: the newest committed step whose every rank reads and whose
// tensors hold no NaN or infinite value, as its commit record counts them
// (a record written before the count existed counts none). It also
// returns the newer committed steps it passed over for holding some.
func (s *Store) LatestWholeFinite(ctx context.Context) (*CommitRecord, []int64, error) {
	return s.latestFinite(ctx, s.wholeCheck(ctx))
}

// LatestFinite is LatestWholeFinite for a reader of one rank, which reads
// the commit records only.
func (s *Store) LatestFinite(ctx context.Context) (*CommitRecord, []int64, error) {
	return s.latestFinite(ctx, nil)
}

func (s *Store) latestFinite(ctx context.Context, check func(*CommitRecord) error) (*CommitRecord, []int64, error) {
	var skipped []int64
	rec, err := s.latestWhere(ctx, func(rec *CommitRecord) error {
		if rec.NonFinite > 0 {
			skipped = append(skipped, rec.Step)
			return errPassOver
		}
		if check == nil {
			return nil
		}
		return check(rec)
	})
	if err != nil && len(skipped) > 0 {
		err = fmt.Errorf("%w (steps %v hold NaN or Inf)", err, skipped)
	}
	return rec, skipped, err
}

func (s *Store) notFound(ctx context.Context, step int64) error {
	latest, err := s.Latest(ctx)
	if err != nil {
		return fmt.Errorf("%w: step %d of job %q is not committed, and the job has no committed steps in %s",
			ErrStepNotFound, step, s.job, s.backend.Location())
	}
	return fmt.Errorf("%w: step %d of job %q is not committed (latest committed step: %d)", ErrStepNotFound, step, s.job, latest)
}

// Committed reports whether step has a commit record.
func (s *Store) Committed(ctx context.Context, step int64) (bool, error) {
	_, err := s.backend.Stat(ctx, commitName(s.job, step))
	if errors.Is(err, storage.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// ReadCommit reads step's commit record: storage.ErrNotFound when the
// step is not committed, ErrCorrupt when its record is damaged.
func (s *Store) ReadCommit(ctx context.Context, step int64) (*CommitRecord, error) {
	name := commitName(s.job, step)
	data, err := s.readObject(ctx, name, maxCommitBytes)
	if err != nil {
		return nil, err
	}
	rec, err := ParseCommit(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if rec.Step != step || rec.Job != s.job {
		return nil, fmt.Errorf("%w: %s describes job %q step %d", ErrCorrupt, name, rec.Job, rec.Step)
	}
	return rec, nil
}

// Manifest reads and validates the manifest a commit record names for
// rank, checking its hash where the record pins one.
func (s *Store) Manifest(ctx context.Context, rec *CommitRecord, rank int) (*Manifest, error) {
	if rank < 0 || rank >= rec.WorldSize {
		return nil, fmt.Errorf("%w: rank %d out of range: step %d has world size %d", ErrInvalid, rank, rec.Step, rec.WorldSize)
	}
	obj, want := rec.manifestObject(rank)
	m, got, err := s.readManifestHash(ctx, inJob(s.job, obj))
	if errors.Is(err, storage.ErrNotFound) {
		return nil, fmt.Errorf("%w: step %d rank %d: the manifest its commit record names is missing: %w", ErrCorrupt, rec.Step, rank, err)
	}
	if err != nil {
		return nil, fmt.Errorf("step %d rank %d: %w", rec.Step, rank, err)
	}
	if want != "" && got != want {
		return nil, fmt.Errorf("%w: manifest of step %d rank %d (%s) has hash %s, but the commit record says %s: it was replaced after the commit",
			ErrCorrupt, rec.Step, rank, obj, got, want)
	}
	if m.Target() != (Target{Job: s.job, Step: rec.Step, Rank: rank, WorldSize: rec.WorldSize, Attempt: rec.Attempt}) {
		return nil, fmt.Errorf("%w: manifest of step %d rank %d describes %s", ErrCorrupt, rec.Step, rank, m.Target())
	}
	return m, nil
}
