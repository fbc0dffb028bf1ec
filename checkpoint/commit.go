package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/storage"
)

// TryCommit commits step for attempt when all world_size of that
// attempt's rank manifests are in the store, creating COMMIT.json only if
// absent. Manifests of other attempts never count, so a committed step
// holds the ranks of exactly one run of the job. It decides from storage,
// not from memory, so sidecars on several nodes sharing a store need no
// coordinator (see the package comment).
//
// It returns the step's commit record when the step is committed, by this
// call or earlier, by this attempt or another (the caller compares
// rec.Attempt), and whether this call wrote it. A nil record and nil
// error mean the attempt's manifests are not all there yet.
func (s *Store) TryCommit(ctx context.Context, step int64, attempt string, worldSize int) (rec *CommitRecord, won bool, err error) {
	t := Target{Job: s.job, Step: step, WorldSize: worldSize, Attempt: attempt}
	if err := t.Validate(); err != nil {
		return nil, false, err
	}
	if rec, err := s.ReadCommit(ctx, step); !errors.Is(err, storage.ErrNotFound) {
		return rec, false, err
	}
	names, err := s.manifestsUnder(ctx, inJob(s.job, attemptDir(step, attempt)))
	if err != nil || len(names) < worldSize {
		return nil, false, err
	}
	return s.commitFrom(ctx, t, names)
}

// commitFrom builds the commit record of t's attempt from its manifests
// names and creates COMMIT.json if absent; it returns the step's record,
// whoever wrote it, and whether this call did. The waiters of the step in
// this process learn the record at once (see PollCommit).
func (s *Store) commitFrom(ctx context.Context, t Target, names []string) (*CommitRecord, bool, error) {
	t.Rank = 0 // the step's, not a rank's
	rec, err := s.summarize(ctx, t, names)
	if err != nil {
		return nil, false, err
	}
	return s.writeCommit(ctx, t, rec)
}

// writeCommit creates t's step's COMMIT.json as rec if absent, and
// returns the step's record, whoever wrote it, and whether this call did.
func (s *Store) writeCommit(ctx context.Context, t Target, rec *CommitRecord) (*CommitRecord, bool, error) {
	data, err := json.MarshalIndent(rec, "", " ")
	if err != nil {
		return nil, false, err
	}
	err = s.backend.PutIfAbsent(ctx, commitName(s.job, t.Step), data)
	if errors.Is(err, storage.ErrExists) { // another sidecar (or attempt) won
		rec, err = s.ReadCommit(ctx, t.Step)
		s.notePoll(t.Step, rec)
		return rec, false, err
	}
	if err != nil {
		return nil, false, fmt.Errorf("commit step %d: %w", t.Step, err)
	}
	s.notePoll(t.Step, rec)
	return rec, true, nil
}

// RemoveRank deletes what a drain of t wrote, best effort: the step was
// committed by another attempt, so it is garbage (prune would remove it
// later if this fails). Its data object may be in either layout.
func (s *Store) RemoveRank(ctx context.Context, t Target) {
	for _, name := range []string{t.manifestName(), inJob(t.Job, t.dataObject()),
		inJob(t.Job, t.spreadDataObject())} {
		if err := s.backend.Delete(ctx, name); err != nil {
			s.log().Warn("could not remove the objects of a save its step will never use; prune removes them", "object", name, "err", err)
		}
	}
}

// manifestsUnder lists the manifests whose names start with prefix.
func (s *Store) manifestsUnder(ctx context.Context, prefix string) ([]string, error) {
	var names []string
	err := s.backend.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		if strings.HasSuffix(oi.Name, manifestSuffix) {
			names = append(names, oi.Name)
		}
		return nil
	})
	return names, err
}

// summarizeConcurrency is how many manifests a commit reads at once: the
// read of every manifest of a step is on the way from its last rank's
// write to its commit record, and a step may have thousands.
const summarizeConcurrency = 32

// summarize reads every manifest of the attempt (summarizeConcurrency at
// a time), checks that they describe ranks 0..worldSize-1 of it, and
// builds the commit record.
func (s *Store) summarize(ctx context.Context, t Target, names []string) (*CommitRecord, error) {
	rec := newRecord(t)
	err := s.readEach(ctx, names, maxManifestBytes, func(name string, data []byte) (func() error, error) {
		m, err := ParseManifest(data)
		return func() error { return rec.add(t, name, m, data) }, err
	})
	if err != nil {
		return nil, err
	}
	return rec, nil
}

// readEach reads the objects names (limit bytes at most each),
// summarizeConcurrency at a time, and has parse take each one's bytes (at
// the same time) into what it returns: a func that counts them, run by
// one reader at a time. The first error stops it.
func (s *Store) readEach(ctx context.Context, names []string, limit int64, parse func(name string, data []byte) (func() error, error)) error {
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(summarizeConcurrency)
	for _, name := range names {
		g.Go(func() error {
			data, err := s.readObject(gctx, name, limit)
			if err != nil {
				return err
			}
			count, err := parse(name, data)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			mu.Lock()
			defer mu.Unlock()
			return count()
		})
	}
	return g.Wait()
}

// newRecord is t's step's commit record with no rank counted yet.
func newRecord(t Target) *CommitRecord {
	return &CommitRecord{
		Format: CommitFormat, Version: CommitVersion, Job: t.Job, Step: t.Step, Attempt: t.Attempt,
		WorldSize: t.WorldSize, CommittedAt: time.Now().UTC(), Manifests: make([]ManifestRef, t.WorldSize),
	}
}

// add counts the manifest m, read from name as data, in the record of t's
// attempt, once it checks that m is one of its ranks, stored where it
// should be.
func (rec *CommitRecord) add(t Target, name string, m *Manifest, data []byte) error {
	mt := m.Target()
	mt.Rank = 0
	if mt != t {
		return fmt.Errorf("%w: %s describes %s; attempt %q of step %d has ranks saved with a world size of %d",
			ErrInvalid, name, m.Target(), t.Attempt, t.Step, t.WorldSize)
	}
	if name != m.Target().manifestName() || rec.Manifests[m.Rank].Object != "" {
		return fmt.Errorf("%w: %s describes rank %d, stored elsewhere", ErrCorrupt, name, m.Rank)
	}
	rec.Manifests[m.Rank] = ManifestRef{Object: Target{Step: t.Step, Attempt: t.Attempt, Rank: m.Rank}.manifestObject(), Hash: codec.HashString(data)}
	rec.Bytes += m.DataSize
	rec.StoredBytes += m.StoredSize
	values, tensors := m.NonFinite()
	rec.NonFinite += values
	rec.NonFiniteTensors += tensors
	return nil
}

// RankManifest reads the manifest t's save stored, committed or not.
func (s *Store) RankManifest(ctx context.Context, t Target) (*Manifest, error) {
	return s.readManifest(ctx, t.manifestName())
}

// readManifest reads and parses the manifest object name (relative to
// the store's root, like every name below).
func (s *Store) readManifest(ctx context.Context, name string) (*Manifest, error) {
	m, _, err := s.readManifestHash(ctx, name)
	return m, err
}

// readManifestHash reads and parses a manifest and returns the hash of its
// bytes, which a commit record pins.
func (s *Store) readManifestHash(ctx context.Context, name string) (*Manifest, string, error) {
	data, err := s.readObject(ctx, name, maxManifestBytes)
	if err != nil {
		return nil, "", err
	}
	m, err := ParseManifest(data)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	return m, codec.HashString(data), nil
}

func (s *Store) readObject(ctx context.Context, name string, limit int64) ([]byte, error) {
	rc, err := s.backend.Get(ctx, name, 0, -1)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := readAll(rc, limit)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return data, nil
}

// readAll reads a whole small object, refusing one larger than limit.
func readAll(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%w: object larger than %d bytes", ErrCorrupt, limit)
	}
	return b, nil
}
