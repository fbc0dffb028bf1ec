package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
	spread, err := s.spreadObjects(ctx)
	if err != nil {
		return nil, err
	}
	for step := range spread { // a step whose data only was written
		if _, found := slices.BinarySearch(steps, step); !found {
			steps = append(steps, step)
		}
	}
	slices.Sort(steps)
	out := make([]StepInventory, len(steps))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(metaConcurrency)
	for i, step := range steps {
		g.Go(func() error {
			inv, err := s.stepInventory(gctx, step, spread[step])
			out[i] = inv
			return err
		})
	}
	return out, g.Wait()
}

// spreadObjects lists the job's spread data objects (WriterOptions.SpreadData)
// by step: one listing of them all, as a step's are in 256 folders.
func (s *Store) spreadObjects(ctx context.Context) (map[int64][]storage.ObjectInfo, error) {
	out := map[int64][]storage.ObjectInfo{}
	err := s.backend.List(ctx, stepsPrefix(s.job)+spreadPrefix, func(oi storage.ObjectInfo) error {
		if step, _ := s.placeOf(oi.Name); step >= 0 {
			out[step] = append(out[step], oi)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the spread data of job %q in %s: %w", s.job, s.backend.Location(), err)
	}
	return out, nil
}

// stepInventory lists step's objects: those in its folder, and spread,
// its spread data objects.
func (s *Store) stepInventory(ctx context.Context, step int64, spread []storage.ObjectInfo) (StepInventory, error) {
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
	add := func(attempt string, oi storage.ObjectInfo) {
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
	}
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
		add(attempt, oi)
		return nil
	})
	if err != nil {
		return inv, err
	}
	for _, oi := range spread {
		_, attempt := s.placeOf(oi.Name)
		add(attempt, oi)
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
