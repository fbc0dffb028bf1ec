package checkpoint

import (
	"context"
	"errors"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/storage"
)

// AttemptInfo describes what one attempt left in a step's folder.
type AttemptInfo struct {
	Attempt   string // "" for format-1 objects, in the step folder itself
	Ranks     int    // rank manifests present
	WorldSize int    // as its manifests say (0 when none is readable)
	Objects   int
	Bytes     int64
	Newest    time.Time // the newest object's modification time
	objects   []storage.ObjectInfo
}

// StepInventory is everything stored under one step: its commit record,
// if any, and each attempt's objects.
type StepInventory struct {
	Step int64
	// Commit is the step's commit record; nil when the step is not
	// committed, or when its record is damaged (Damaged says why).
	Commit   *CommitRecord
	Damaged  error
	Attempts []AttemptInfo
}

// Committed returns the attempt the commit record names, and whether
// there is a valid one.
func (si *StepInventory) Committed() (string, bool) {
	if si.Commit == nil {
		return "", false
	}
	return si.Commit.Attempt, true
}

// Inventory lists every step of the job with every attempt's objects: what
// `ckptd list --all` shows and `ckptd prune` decides from. Unlike Steps it
// lists every object, so it costs a listing of the whole job.
func (s *Store) Inventory(ctx context.Context) ([]StepInventory, error) {
	steps, err := s.allSteps(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]StepInventory, len(steps))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(metaConcurrency)
	for i, step := range steps {
		g.Go(func() error {
			inv, err := s.stepInventory(gctx, step)
			out[i] = inv
			return err
		})
	}
	return out, g.Wait()
}

func (s *Store) stepInventory(ctx context.Context, step int64) (StepInventory, error) {
	inv := StepInventory{Step: step}
	rec, err := s.ReadCommit(ctx, step)
	switch {
	case err == nil:
		inv.Commit = rec
	case errors.Is(err, ErrCorrupt):
		inv.Damaged = err
	case !errors.Is(err, storage.ErrNotFound):
		return inv, err
	}
	byAttempt := map[string]*AttemptInfo{}
	var order []string
	dir := stepDir(s.job, step)
	err = s.backend.List(ctx, dir, func(oi storage.ObjectInfo) error {
		rel := strings.TrimPrefix(oi.Name, dir)
		if rel == commitFile {
			return nil
		}
		attempt, _, found := strings.Cut(rel, "/")
		if !found {
			attempt = "" // a format-1 object
		}
		a := byAttempt[attempt]
		if a == nil {
			a = &AttemptInfo{Attempt: attempt}
			byAttempt[attempt] = a
			order = append(order, attempt)
		}
		a.objects = append(a.objects, oi)
		a.Objects++
		a.Bytes += oi.Size
		if oi.ModTime.After(a.Newest) {
			a.Newest = oi.ModTime
		}
		if strings.HasSuffix(oi.Name, manifestSuffix) {
			a.Ranks++
		}
		return nil
	})
	if err != nil {
		return inv, err
	}
	for _, name := range order {
		a := byAttempt[name]
		a.WorldSize = s.worldSizeOf(ctx, a)
		inv.Attempts = append(inv.Attempts, *a)
	}
	return inv, nil
}

// worldSizeOf reads one of an attempt's manifests for its world size.
func (s *Store) worldSizeOf(ctx context.Context, a *AttemptInfo) int {
	for _, oi := range a.objects {
		if strings.HasSuffix(oi.Name, manifestSuffix) {
			if m, err := s.readManifest(ctx, oi.Name); err == nil {
				return m.WorldSize
			}
		}
	}
	return 0
}
