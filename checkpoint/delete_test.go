package checkpoint

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func committedSteps(t *testing.T, s *Store) []int64 {
	t.Helper()
	recs, err := s.Steps(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var steps []int64
	for _, r := range recs {
		steps = append(steps, r.Step)
	}
	return steps
}

func TestDeleteStep(t *testing.T) {
	ctx := context.Background()
	b, dir := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	for _, s := range []int64{1, 2, 3, 4} {
		writeStep(t, b, w, s, 2)
	}
	if _, err := w.WriteShard(ctx, testShard(5, 0, 2)); err != nil { // in flight: one rank of two
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	for _, tc := range []struct {
		step int64
		want error
	}{
		{4, ErrNeedsForce},   // the newest committed step
		{5, ErrNeedsForce},   // not committed: may be in flight
		{9, ErrStepNotFound}, // not there at all
		{-1, ErrInvalid},
	} {
		if _, err := store.DeleteStep(ctx, tc.step, DeleteOptions{}); !errors.Is(err, tc.want) {
			t.Errorf("DeleteStep(%d) = %v, want %v", tc.step, err, tc.want)
		}
	}
	if got := committedSteps(t, store); !slices.Equal(got, []int64{1, 2, 3, 4}) {
		t.Fatalf("after refused deletes the committed steps are %v", got)
	}

	dry, err := store.DeleteStep(ctx, 2, DeleteOptions{DryRun: true})
	if err != nil || !slices.Equal(dry.Removed, []int64{2}) || dry.Objects != 5 {
		t.Fatalf("dry run: %+v, %v; want step 2's commit record, 2 manifests and 2 data objects", dry, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "job/steps/000000000002/COMMIT.json")); err != nil {
		t.Fatal("the dry run deleted something")
	}
	rep, err := store.DeleteStep(ctx, 2, DeleteOptions{})
	if err != nil || rep.Objects != dry.Objects || rep.Bytes != dry.Bytes {
		t.Fatalf("DeleteStep(2) = %+v, %v; the dry run said %+v", rep, err, dry)
	}
	if _, err := os.Stat(filepath.Join(dir, "job/steps/000000000002")); !os.IsNotExist(err) {
		t.Errorf("step 2's folder is still there: %v", err)
	}
	if got := committedSteps(t, store); !slices.Equal(got, []int64{1, 3, 4}) {
		t.Fatalf("after deleting step 2 the committed steps are %v", got)
	}
	for _, s := range []int64{1, 3, 4} {
		if _, err := store.Verify(ctx, s, false, ReadOptions{}); err != nil {
			t.Errorf("step %d after deleting step 2: %v", s, err)
		}
	}

	if _, err := store.DeleteStep(ctx, 4, DeleteOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	if latest, err := store.Latest(ctx); err != nil || latest != 3 {
		t.Errorf("latest after a forced delete of step 4 = %d, %v; want 3", latest, err)
	}
	if _, err := store.DeleteStep(ctx, 5, DeleteOptions{Force: true}); err != nil {
		t.Errorf("forced delete of the uncommitted step 5: %v", err)
	}
}

func TestDeleteJob(t *testing.T) {
	ctx := context.Background()
	b, dir := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	for _, s := range []int64{1, 2} {
		writeStep(t, b, w, s, 1)
	}
	other, _ := NewStore(b, "job2") // a job whose name starts with the other's
	store, _ := NewStore(b, "job")
	if err := b.Put(ctx, "job2/steps/000000000001/keep", strings.NewReader(""), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := store.DeleteJob(ctx, DeleteOptions{}); !errors.Is(err, ErrNeedsForce) {
		t.Fatalf("DeleteJob of a job with committed steps, not forced = %v, want ErrNeedsForce", err)
	}
	rep, err := store.DeleteJob(ctx, DeleteOptions{Force: true})
	if err != nil || !slices.Equal(rep.Removed, []int64{1, 2}) {
		t.Fatalf("DeleteJob = %+v, %v", rep, err)
	}
	entries, _ := os.ReadDir(filepath.Join(dir, "job"))
	if len(entries) != 0 {
		t.Errorf("the job's folder still holds %v", entries)
	}
	if _, err := os.Stat(filepath.Join(dir, "job2/steps/000000000001/keep")); err != nil {
		t.Errorf("deleting job removed job2's object: %v", err)
	}
	if _, err := other.DeleteJob(ctx, DeleteOptions{}); !errors.Is(err, ErrNeedsForce) {
		t.Errorf("DeleteJob of a job a save may still be writing, not forced = %v, want ErrNeedsForce", err)
	}
	if _, err := other.DeleteJob(ctx, DeleteOptions{Force: true}); err != nil {
		t.Errorf("forced DeleteJob of a job a save may still be writing: %v", err)
	}
}

func TestPruneKeepEvery(t *testing.T) {
	ctx := context.Background()
	b, _ := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	for s := int64(1); s <= 7; s++ {
		writeStep(t, b, w, s, 1)
	}
	store, _ := NewStore(b, "job")
	for _, opts := range []PruneOptions{{KeepLast: 0}, {KeepLast: -1, KeepEvery: 2}, {KeepLast: 1, KeepEvery: -2}} {
		if _, err := store.Prune(ctx, opts); !errors.Is(err, ErrInvalid) {
			t.Errorf("Prune(%+v) = %v, want ErrInvalid", opts, err)
		}
	}
	rep, err := store.Prune(ctx, PruneOptions{KeepLast: 1, KeepEvery: 3})
	if err != nil || !slices.Equal(rep.Kept, []int64{3, 6, 7}) || !slices.Equal(rep.Removed, []int64{1, 2, 4, 5}) {
		t.Fatalf("Prune keep-last 1 keep-every 3 = %+v, %v", rep, err)
	}
	rep, err = store.Prune(ctx, PruneOptions{KeepLast: 0, KeepEvery: 3})
	if err != nil || !slices.Equal(rep.Kept, []int64{3, 6}) || !slices.Equal(rep.Removed, []int64{7}) {
		t.Fatalf("Prune keep-last 0 keep-every 3 = %+v, %v", rep, err)
	}
	if got := committedSteps(t, store); !slices.Equal(got, []int64{3, 6}) {
		t.Errorf("left %v", got)
	}
}
