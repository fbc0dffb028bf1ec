package checkpoint

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// With WriterOptions.SpreadData a rank's data goes under steps/spread-<hh>/
// (the manifests and the commit record stay in the step's folder): it
// restores and verifies through the manifests; the inventory counts it in
// its attempt; prune removes it with its step, and a step whose data only
// was written (its writer died before the manifest) once past the grace;
// RemoveRank removes it.
func TestSpreadData(t *testing.T) {
	ctx := context.Background()
	b, dir := newBackend(t)
	w, err := NewWriter(b, WriterOptions{SpreadData: true})
	if err != nil {
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	for _, step := range []int64{1, 2, 3} {
		shards := writeStep(t, b, w, step, 2)
		rec, err := store.Resolve(ctx, step, false)
		if err != nil {
			t.Fatal(err)
		}
		for _, sh := range shards {
			m, err := store.Manifest(ctx, rec, sh.Target.Rank)
			if err != nil {
				t.Fatal(err)
			}
			if want := (Target{Step: step, Attempt: testAttempt, Rank: sh.Target.Rank}).spreadDataObject(); m.Chunks[0].Object != want {
				t.Fatalf("data object %q, want %q", m.Chunks[0].Object, want)
			}
		}
	}
	if _, err := store.Verify(ctx, 3, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	inv, err := store.Inventory(ctx)
	if err != nil || len(inv) != 3 || inv[0].Attempts[0].Objects != 4 {
		t.Fatalf("inventory %+v, %v; want 3 steps of 2 manifests and 2 data objects each", inv, err)
	}
	// Step 4: rank 0's data written, its writer gone before the manifest.
	orphan := Target{Step: 4, Attempt: testAttempt, Rank: 0}.spreadDataObject()
	if err := b.PutIfAbsent(ctx, inJob("job", orphan), []byte("data")); err != nil {
		t.Fatal(err)
	}
	rep, err := store.Prune(ctx, PruneOptions{KeepLast: 1, Now: time.Now().Add(2 * time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rep.Removed, []int64{1, 2}) || !slices.Equal(rep.Garbage, []AttemptRef{{4, testAttempt}}) {
		t.Fatalf("prune report %+v", rep)
	}
	var left []string
	err = filepath.WalkDir(filepath.Join(dir, "job"), func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			left = append(left, strings.TrimPrefix(path, dir+"/job/"))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range left {
		if !strings.Contains(name, "/000000000003/") {
			t.Errorf("%s left after prune", name)
		}
	}
	if len(left) != 5 { // step 3: COMMIT.json, 2 manifests, 2 data objects
		t.Fatalf("left %v", left)
	}
	store.RemoveRank(ctx, Target{Job: "job", Step: 3, Rank: 1, WorldSize: 2, Attempt: testAttempt})
	if _, err := os.Stat(filepath.Join(dir, "job", Target{Step: 3, Attempt: testAttempt, Rank: 1}.spreadDataObject())); !os.IsNotExist(err) {
		t.Fatalf("RemoveRank left the spread data: %v", err)
	}
}

// placeOf reads the step and attempt of either layout's names.
func TestPlaceOf(t *testing.T) {
	s := &Store{job: "job"}
	for _, tc := range []struct {
		name    string
		step    int64
		attempt string
	}{
		{"job/steps/000000000007/run-1/rank-00000.data", 7, "run-1"},
		{"job/steps/000000000007/rank-00000.data", 7, ""},
		{"job/steps/spread-3f/000000000007/run-1/rank-00000.data", 7, "run-1"},
		{"job/steps/spread-3f/000000000007/rank-00000.data", -1, ""},
		{"job/steps/spread-3g/000000000007/run-1/rank-00000.data", -1, ""},
		{"job/steps/spread-3f0/000000000007/run-1/rank-00000.data", -1, ""},
		{"job/steps/spread-3f/7/run-1/rank-00000.data", -1, ""},
		{"other/steps/000000000007/run-1/rank-00000.data", -1, ""},
	} {
		if step, attempt := s.placeOf(tc.name); step != tc.step || attempt != tc.attempt {
			t.Errorf("placeOf(%q) = %d, %q; want %d, %q", tc.name, step, attempt, tc.step, tc.attempt)
		}
	}
	seen := map[byte]bool{}
	for rank := range 4096 {
		seen[spreadOf(rank)] = true
	}
	if len(seen) != 256 {
		t.Fatalf("4,096 ranks spread over %d folders, want 256", len(seen))
	}
}
