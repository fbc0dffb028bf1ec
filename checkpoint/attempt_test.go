package checkpoint

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// shardOf is testShard saved by attempt, with data that differs between
// attempts so a mix would show.
func shardOf(attempt string, step int64, rank, world int) *Shard {
	sh := testShard(step, rank, world)
	sh.Target.Attempt = attempt
	sh.Data = append([]byte(nil), sh.Data...)
	copy(sh.Data, attempt) // the first weight bytes name the attempt
	return sh
}

func save(t *testing.T, b storage.Backend, sh *Shard) *CommitRecord {
	t.Helper()
	w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteShard(context.Background(), sh); err != nil {
		t.Fatal(err)
	}
	tg := sh.Target
	rec, _, err := (&Store{backend: b, job: tg.Job}).TryCommit(context.Background(), tg.Step, tg.Attempt, tg.WorldSize)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

// restoredAttempts restores every rank of step and returns which attempt
// wrote each (from the bytes), checking them against want's data.
func checkStep(t *testing.T, b storage.Backend, step int64, want []*Shard) {
	t.Helper()
	store, _ := NewStore(b, "job")
	rec, err := store.Resolve(context.Background(), step, false)
	if err != nil {
		t.Fatal(err)
	}
	if rec.WorldSize != len(want) || rec.Attempt != want[0].Target.Attempt {
		t.Fatalf("step %d committed attempt %q world %d, want %q world %d", step, rec.Attempt, rec.WorldSize, want[0].Target.Attempt, len(want))
	}
	for rank, sh := range want {
		m, err := store.Manifest(context.Background(), rec, rank)
		if err != nil {
			t.Fatal(err)
		}
		got := make(BufferSink, m.DataSize)
		if err := store.ReadShard(context.Background(), m, got, ReadOptions{}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, sh.Data) {
			t.Fatalf("step %d rank %d: restored bytes are not attempt %q's (they start %q)", step, rank, sh.Target.Attempt, got[:8])
		}
	}
}

// A crashed run left rank 0 durable; the next run saves both ranks and the
// step commits with the new run's ranks only.
func TestCommitOneAttempt(t *testing.T) {
	b, _ := newBackend(t)
	if rec := save(t, b, shardOf("run-a", 100, 0, 2)); rec != nil {
		t.Fatal("committed with one rank")
	}
	if rec := save(t, b, shardOf("run-b", 100, 1, 2)); rec != nil {
		t.Fatalf("committed with rank 0 of run-a and rank 1 of run-b: %+v", rec)
	}
	b0 := shardOf("run-b", 100, 0, 2)
	if rec := save(t, b, b0); rec == nil || rec.Attempt != "run-b" {
		t.Fatalf("run-b complete: %+v", rec)
	}
	checkStep(t, b, 100, []*Shard{b0, shardOf("run-b", 100, 1, 2)})
}

// A run at world size 4 left ranks 2 and 3; a rerun at 2 commits.
func TestCommitAfterResize(t *testing.T) {
	b, _ := newBackend(t)
	save(t, b, shardOf("big", 7, 2, 4))
	save(t, b, shardOf("big", 7, 3, 4))
	save(t, b, shardOf("small", 7, 0, 2))
	if rec := save(t, b, shardOf("small", 7, 1, 2)); rec == nil || rec.Attempt != "small" || rec.WorldSize != 2 {
		t.Fatalf("rerun at world size 2: %+v", rec)
	}
	checkStep(t, b, 7, []*Shard{shardOf("small", 7, 0, 2), shardOf("small", 7, 1, 2)})
	// The late ranks of the old run do not change the step.
	if rec := save(t, b, shardOf("big", 7, 0, 4)); rec == nil || rec.Attempt != "small" {
		t.Fatalf("after a late rank of the old run: %+v", rec)
	}
}

// A manifest swapped after the commit is caught by the hash the commit
// record pins.
func TestManifestReplacedAfterCommit(t *testing.T) {
	b, dir := newBackend(t)
	save(t, b, shardOf("run", 1, 0, 1))
	p := filepath.Join(dir, "job/steps/000000000001/run/rank-00000.manifest.json")
	data, _ := os.ReadFile(p)
	if err := os.WriteFile(p, append(data, ' '), 0o600); err != nil { // still a valid manifest
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	rec, _ := store.Resolve(context.Background(), 1, false)
	if _, err := store.Manifest(context.Background(), rec, 0); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "replaced after the commit") {
		t.Fatalf("Manifest = %v", err)
	}
}

// writeFormat1 rewrites a committed step into the layout the release
// before attempts wrote: objects in the step folder, manifest and commit
// record version 1.
func writeFormat1(t *testing.T, b storage.Backend, dir string, sh *Shard) {
	t.Helper()
	save(t, b, sh)
	step := filepath.Join(dir, "job/steps", stepSegment(sh.Target.Step))
	attempt := sh.Target.Attempt
	if err := os.Rename(filepath.Join(step, attempt, "rank-00000.data"), filepath.Join(step, "rank-00000.data")); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	raw, _ := os.ReadFile(filepath.Join(step, attempt, "rank-00000.manifest.json"))
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	m["version"] = 1
	delete(m, "attempt")
	for _, c := range m["chunks"].([]any) {
		c.(map[string]any)["object"] = "steps/" + stepSegment(sh.Target.Step) + "/rank-00000.data"
	}
	writeJSON(t, filepath.Join(step, "rank-00000.manifest.json"), m)
	var rec map[string]any
	raw, _ = os.ReadFile(filepath.Join(step, commitFile))
	_ = json.Unmarshal(raw, &rec)
	rec["version"] = 1
	delete(rec, "attempt")
	delete(rec, "manifests")
	writeJSON(t, filepath.Join(step, commitFile), rec)
	if err := os.RemoveAll(filepath.Join(step, attempt)); err != nil {
		t.Fatal(err)
	}
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	data, _ := json.MarshalIndent(v, "", " ")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// A store written before attempts existed lists, restores, verifies and
// prunes.
func TestFormat1StoreReadable(t *testing.T) {
	b, dir := newBackend(t)
	old := shardOf("x", 5, 0, 1)
	writeFormat1(t, b, dir, old)
	save(t, b, shardOf("new", 6, 0, 1))
	store, _ := NewStore(b, "job")
	recs, err := store.Steps(context.Background())
	if err != nil || len(recs) != 2 || recs[0].Version != 1 || recs[0].Attempt != "" {
		t.Fatalf("Steps = %+v, %v", recs, err)
	}
	old.Target.Attempt = ""
	checkStep(t, b, 5, []*Shard{old})
	if _, err := store.Verify(context.Background(), 5, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	rep, err := store.Prune(context.Background(), PruneOptions{KeepLast: 2})
	if err != nil || len(rep.Garbage) != 0 || rep.Objects != 0 {
		t.Fatalf("prune of a healthy mixed store: %+v, %v", rep, err)
	}
}

// One damaged commit record does not blind the job: listing skips it,
// --latest falls back to the newest readable step, prune leaves it.
func TestDamagedCommitSkipped(t *testing.T) {
	b, dir := newBackend(t)
	for _, s := range []int64{1, 2, 3} {
		save(t, b, shardOf("run", s, 0, 1))
	}
	if err := os.Truncate(filepath.Join(dir, "job/steps/000000000003/COMMIT.json"), 20); err != nil {
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	recs, err := store.Steps(context.Background())
	if err != nil || len(recs) != 2 {
		t.Fatalf("Steps = %+v, %v", recs, err)
	}
	if latest, err := store.Latest(context.Background()); err != nil || latest != 2 {
		t.Fatalf("Latest = %d, %v", latest, err)
	}
	if _, err := store.Resolve(context.Background(), 3, false); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Resolve(3) = %v, want ErrCorrupt", err)
	}
	rep, err := store.Prune(context.Background(), PruneOptions{KeepLast: 1})
	if err != nil || !slices.Equal(rep.Damaged, []int64{3}) || !slices.Equal(rep.Removed, []int64{1}) {
		t.Fatalf("prune: %+v, %v", rep, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "job/steps/000000000003/run/rank-00000.data")); err != nil {
		t.Fatal("prune touched the damaged step")
	}
}

// Prune removes the attempts a commit does not name, at once for a
// committed step, and keeps the winner restorable.
func TestPruneLosingAttempts(t *testing.T) {
	b, dir := newBackend(t)
	save(t, b, shardOf("loser", 9, 0, 2))
	w0, w1 := shardOf("winner", 9, 0, 2), shardOf("winner", 9, 1, 2)
	save(t, b, w0)
	save(t, b, w1)
	store, _ := NewStore(b, "job")
	inv, err := store.Inventory(context.Background())
	if err != nil || len(inv) != 1 || len(inv[0].Attempts) != 2 {
		t.Fatalf("Inventory = %+v, %v", inv, err)
	}
	for _, a := range inv[0].Attempts {
		if a.Ranks == 0 || a.WorldSize != 2 {
			t.Fatalf("attempt %+v", a)
		}
	}
	rep, err := store.Prune(context.Background(), PruneOptions{KeepLast: 1})
	if err != nil || !slices.Equal(rep.Garbage, []AttemptRef{{9, "loser"}}) || rep.Objects != 2 {
		t.Fatalf("prune: %+v, %v", rep, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "job/steps/000000000009/loser")); !os.IsNotExist(err) {
		t.Fatal("the losing attempt is still there")
	}
	checkStep(t, b, 9, []*Shard{w0, w1})
}

// Jobs lists the folders that hold steps, not stray ones.
func TestJobs(t *testing.T) {
	b, dir := newBackend(t)
	save(t, b, shardOf("run", 1, 0, 1))
	sh := shardOf("run", 1, 0, 1)
	sh.Target.Job = "other"
	save(t, b, sh)
	if err := os.MkdirAll(filepath.Join(dir, "stray", "x"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "stray", "x", "f"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	jobs, err := Jobs(context.Background(), b)
	if err != nil || !slices.Equal(jobs, []string{"job", "other"}) {
		t.Fatalf("Jobs = %v, %v", jobs, err)
	}
}

// A step that commits after Prune took its inventory (a late drain) is not
// treated as garbage: Prune reads the commit record again before deleting.
func TestPruneSeesLateCommit(t *testing.T) {
	b, _ := newBackend(t)
	save(t, b, shardOf("old", 1, 0, 1))
	r0, r1 := shardOf("late", 2, 0, 2), shardOf("late", 2, 1, 2)
	save(t, b, r0)
	save(t, b, shardOf("newer", 3, 0, 1))
	store, _ := NewStore(b, "job")
	inv, err := store.Inventory(context.Background())
	if err != nil || len(inv) != 3 || inv[1].Commit != nil {
		t.Fatalf("Inventory = %+v, %v", inv, err)
	}
	save(t, b, r1) // step 2 commits after the inventory
	p := &pruner{s: store, refs: map[string]bool{}, rep: &PruneReport{}}
	if err := p.removeGarbage(context.Background(), &inv[1], time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if len(p.rep.Garbage) != 0 {
		t.Fatalf("removed %v of a step committed meanwhile", p.rep.Garbage)
	}
	checkStep(t, b, 2, []*Shard{r0, r1})
}

// rangeSink keeps what falls in [off, off+len(buf)) and counts the chunks
// it was handed.
type rangeSink struct {
	off    int64
	buf    []byte
	mu     sync.Mutex
	chunks int
}

func (s *rangeSink) WriteAt(p []byte, at int64) (int, error) {
	s.mu.Lock()
	s.chunks++
	s.mu.Unlock()
	lo, hi := max(at, s.off), min(at+int64(len(p)), s.off+int64(len(s.buf)))
	if lo < hi {
		copy(s.buf[lo-s.off:hi-s.off], p[lo-at:hi-at])
	}
	return len(p), nil
}

// ReadRange fetches only the chunks holding a tensor, and the tensor's
// bytes come back exactly.
func TestReadRange(t *testing.T) {
	b, _ := newBackend(t)
	sh := shardOf("run", 1, 0, 1)
	save(t, b, sh)
	store, _ := NewStore(b, "job")
	rec, err := store.Resolve(context.Background(), 1, false)
	if err != nil {
		t.Fatal(err)
	}
	m, err := store.Manifest(context.Background(), rec, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range m.Tensors {
		s := &rangeSink{off: tn.Offset, buf: make([]byte, tn.Length)}
		if err := store.ReadRange(context.Background(), m, tn.Offset, tn.Length, s, ReadOptions{}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(s.buf, sh.Data[tn.Offset:tn.Offset+tn.Length]) {
			t.Fatalf("tensor %s: wrong bytes", tn.Name)
		}
		if tn.Length > 0 && s.chunks >= len(m.Chunks) && len(m.Chunks) > 2 {
			t.Fatalf("tensor %s (%d bytes): read %d of %d chunks", tn.Name, tn.Length, s.chunks, len(m.Chunks))
		}
	}
	if err := store.ReadRange(context.Background(), m, m.DataSize, 1, &rangeSink{}, ReadOptions{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a range past the shard: %v", err)
	}
}
