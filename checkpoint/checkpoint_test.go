package checkpoint

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

func newBackend(t *testing.T) (storage.Backend, string) { return newBackendTB(t) }

func newBackendTB(t testing.TB) (storage.Backend, string) {
	t.Helper()
	dir := t.TempDir()
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, dir
}

// floats returns n float32 values of a trained-weight-like spread.
func floats(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, 4*n)
	for i := range n {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
	}
	return b
}

// bf16s returns n bf16 values of a trained-weight-like spread: the top
// halves of floats (the bottom halves, read as bf16, include NaNs).
func bf16s(n int, seed uint64) []byte {
	f := floats(n, seed)
	b := make([]byte, 2*n)
	for i := range n {
		copy(b[2*i:], f[4*i+2:4*i+4])
	}
	return b
}

// testAttempt is the attempt the tests' shards are saved by.
const testAttempt = "run-1"

// testShard builds a packed shard: an fp32 matrix, a small int64 tensor, a
// 0-d tensor, an empty one, and a bf16 tensor.
func testShard(step int64, rank, world int) *Shard {
	var ts []Tensor
	var data []byte
	add := func(name string, dt dtype.DType, shape []int64, b []byte) {
		ts = append(ts, Tensor{Name: name, DType: dt, Shape: shape, Offset: int64(len(data)), Length: int64(len(b))})
		data = append(data, b...)
	}
	add("layer.0.weight", dtype.F32, []int64{512, 700}, floats(512*700, uint64(step)+uint64(rank)))
	add("step_count", dtype.I64, []int64{3}, make([]byte, 24))
	add("scalar", dtype.F32, []int64{}, floats(1, 7))
	add("empty", dtype.F16, []int64{0, 5}, nil)
	add("layer.0.bias", dtype.BF16, []int64{700}, bf16s(700, 9))
	l, err := NewLayout(ts)
	if err != nil {
		panic(err)
	}
	return &Shard{Target: Target{Job: "job", Step: step, Rank: rank, WorldSize: world, Attempt: testAttempt}, Layout: l, Data: data, Metadata: []byte("loader=42")}
}

func writeStep(t *testing.T, b storage.Backend, w *Writer, step int64, world int) []*Shard {
	t.Helper()
	var shards []*Shard
	for rank := range world {
		sh := testShard(step, rank, world)
		if _, err := w.WriteShard(context.Background(), sh); err != nil {
			t.Fatal(err)
		}
		rec, won, err := (&Store{backend: b, job: "job"}).TryCommit(context.Background(), step, testAttempt, world)
		if ok := rec != nil; err != nil || ok != (rank == world-1) || won != ok {
			t.Fatalf("TryCommit after rank %d = %v, %v", rank, rec, err)
		}
		shards = append(shards, sh)
	}
	return shards
}

func TestWriteCommitRestore(t *testing.T) {
	for _, c := range []codec.Codec{codec.Zstd, codec.LZ4, codec.None} {
		t.Run(string(c), func(t *testing.T) {
			b, _ := newBackend(t)
			w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Codec: c, Workers: 3})
			if err != nil {
				t.Fatal(err)
			}
			shards := writeStep(t, b, w, 7, 2)
			store, _ := NewStore(b, "job")
			rec, err := store.Resolve(context.Background(), 0, true)
			if err != nil || rec.Step != 7 || rec.WorldSize != 2 {
				t.Fatalf("Resolve latest = %+v, %v", rec, err)
			}
			for rank, sh := range shards {
				m, err := store.Manifest(context.Background(), rec, rank)
				if err != nil {
					t.Fatal(err)
				}
				if string(m.Metadata) != "loader=42" {
					t.Errorf("metadata %q", m.Metadata)
				}
				got := make(BufferSink, m.DataSize)
				if err := store.ReadShard(context.Background(), m, got, ReadOptions{}); err != nil {
					t.Fatal(err)
				}
				if string(got) != string(sh.Data) {
					t.Fatal("restored bytes differ")
				}
			}
			if _, err := store.Verify(context.Background(), 7, false, ReadOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestCorruptChunkNamed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(path string) error
		want   string
	}{
		{"flipped byte", func(p string) error {
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			_, err = f.WriteAt([]byte{0xff, 0x00, 0xff}, 70000)
			return err
		}, "chunk 1"},
		{"truncated", func(p string) error { return os.Truncate(p, 1000) }, "truncated"},
		{"deleted", os.Remove, "not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, dir := newBackend(t)
			w, _ := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Codec: codec.None})
			writeStep(t, b, w, 3, 1)
			if err := tc.damage(filepath.Join(dir, "job/steps/000000000003/"+testAttempt+"/rank-00000.data")); err != nil {
				t.Fatal(err)
			}
			store, _ := NewStore(b, "job")
			_, err := store.Verify(context.Background(), 3, false, ReadOptions{})
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "step 3 rank 0") || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Verify = %v; want ErrCorrupt naming step 3 rank 0 and %q", err, tc.want)
			}
		})
	}
}

func TestUnknownStepNamesLatest(t *testing.T) {
	b, _ := newBackend(t)
	store, _ := NewStore(b, "job")
	if _, err := store.Resolve(context.Background(), 5, false); !errors.Is(err, ErrStepNotFound) || !strings.Contains(err.Error(), "no committed steps") {
		t.Fatalf("empty store: %v", err)
	}
	w, _ := NewWriter(b, WriterOptions{})
	writeStep(t, b, w, 10, 1)
	_, err := store.Resolve(context.Background(), 11, false)
	if !errors.Is(err, ErrStepNotFound) || !strings.Contains(err.Error(), "latest committed step: 10") {
		t.Fatalf("Resolve(11) = %v", err)
	}
}

func TestCommitNeedsAllRanks(t *testing.T) {
	b, _ := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	if _, err := w.WriteShard(context.Background(), testShard(1, 1, 3)); err != nil {
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	if rec, _, _ := store.TryCommit(context.Background(), 1, testAttempt, 3); rec != nil {
		t.Fatal("committed with 1 of 3 ranks")
	}
	if steps, _ := store.Steps(context.Background()); len(steps) != 0 {
		t.Fatalf("uncommitted step listed: %v", steps)
	}
	// A rank of the same step claiming another world size is a conflict.
	for _, r := range []int{0, 2} {
		if _, err := w.WriteShard(context.Background(), testShard(1, r, 3)); err != nil {
			t.Fatal(err)
		}
	}
	if rec, won, err := store.TryCommit(context.Background(), 1, testAttempt, 3); rec == nil || !won || err != nil {
		t.Fatalf("TryCommit = %v, %v, %v", rec, won, err)
	}
	if rec, won, err := store.TryCommit(context.Background(), 1, testAttempt, 3); rec == nil || won || err != nil {
		t.Fatalf("second TryCommit = %v, %v, %v", rec, won, err)
	}
}

func TestPrune(t *testing.T) {
	b, dir := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	for _, s := range []int64{1, 2, 3, 4} {
		writeStep(t, b, w, s, 1)
	}
	// An incomplete step older than what we keep, and one newer (in flight).
	for _, s := range []int64{2, 5} {
		if _, err := w.WriteShard(context.Background(), testShard(s, 1, 2)); err != nil && s == 5 {
			t.Fatal(err)
		}
	}
	if _, err := w.WriteShard(context.Background(), testShard(0, 0, 2)); err != nil {
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	opts := PruneOptions{KeepLast: 2, DryRun: true, Now: time.Now().Add(2 * time.Hour)}
	dry, err := store.Prune(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "job/steps/000000000001/COMMIT.json")); err != nil {
		t.Fatal("dry run deleted something")
	}
	// Step 5's attempt is younger than the grace: in flight, kept.
	opts.DryRun, opts.Now = false, time.Now()
	rep, err := store.Prune(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Removed) != 2 || rep.Removed[1] != 2 || len(rep.Garbage) != 0 {
		t.Fatalf("report %+v", rep)
	}
	if want := []AttemptRef{{0, testAttempt}, {5, testAttempt}}; !slices.Equal(dry.Garbage, want) {
		t.Fatalf("dry run past the grace: garbage %v, want %v", dry.Garbage, want)
	}
	steps, _ := store.Steps(context.Background())
	if len(steps) != 2 || steps[0].Step != 3 {
		t.Fatalf("left %v", steps)
	}
	for _, s := range []string{"000000000005", "000000000000"} {
		if _, err := os.Stat(filepath.Join(dir, "job/steps", s)); err != nil {
			t.Fatalf("step %s, in flight within the grace, was pruned", s)
		}
	}
	if _, err := store.Verify(context.Background(), 3, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	// Past the grace, the uncommitted attempts go, older or newer than the
	// newest commit (step 5: a run that died mid-save and never saved
	// again). The kept steps stay.
	opts.Now = time.Now().Add(2 * time.Hour)
	rep, err = store.Prune(context.Background(), opts)
	if err != nil || !slices.Equal(rep.Garbage, []AttemptRef{{0, testAttempt}, {5, testAttempt}}) {
		t.Fatalf("past the grace: %+v, %v", rep, err)
	}
	for _, s := range []string{"000000000005", "000000000000"} {
		if _, err := os.Stat(filepath.Join(dir, "job/steps", s, testAttempt)); !os.IsNotExist(err) {
			t.Fatalf("step %s: an abandoned attempt survived prune past the grace", s)
		}
	}
	if _, err := store.Verify(context.Background(), 4, false, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Prune(context.Background(), PruneOptions{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("keep-last 0: %v", err)
	}
}

// TestStepsFromDirectories: steps come from the step folders; a folder
// that is not a 12-digit step, or a step with no commit record, is not a
// committed step, and Latest skips a newer step still in flight.
func TestStepsFromDirectories(t *testing.T) {
	b, _ := newBackend(t)
	w, _ := NewWriter(b, WriterOptions{})
	for _, s := range []int64{3, 1, 20} {
		writeStep(t, b, w, s, 1)
	}
	if _, err := w.WriteShard(context.Background(), testShard(21, 0, 2)); err != nil { // in flight
		t.Fatal(err)
	}
	for _, stray := range []string{"+00000000002", "2", "abc", "0000000000022x"} {
		if err := b.Put(context.Background(), "job/steps/"+stray+"/COMMIT.json", strings.NewReader("{}"), 2); err != nil {
			t.Fatal(err)
		}
	}
	store, _ := NewStore(b, "job")
	recs, err := store.Steps(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, r := range recs {
		got = append(got, r.Step)
	}
	if !slices.Equal(got, []int64{1, 3, 20}) {
		t.Fatalf("Steps = %v, want [1 3 20]", got)
	}
	if latest, err := store.Latest(context.Background()); err != nil || latest != 20 {
		t.Fatalf("Latest = %d, %v, want 20", latest, err)
	}
}

// TestHoldsSameWithGaps: the replay check hashes each chunk's bytes where
// they sit in the region, which differs from data space when the client
// leaves gaps between tensors (aligning each to its element size).
func TestHoldsSameWithGaps(t *testing.T) {
	b, _ := newBackend(t)
	w, err := NewWriter(b, WriterOptions{ChunkSize: 4096})
	if err != nil {
		t.Fatal(err)
	}
	tensors := []Tensor{
		{Name: "bias", DType: dtype.BF16, Shape: []int64{3}, Offset: 0, Length: 6},
		{Name: "w", DType: dtype.BF16, Shape: []int64{5000}, Offset: 8, Length: 10000},    // 2-byte gap before
		{Name: "x", DType: dtype.F32, Shape: []int64{3000}, Offset: 10012, Length: 12000}, // 4-byte gap before
	}
	l, err := NewLayout(tensors)
	if err != nil {
		t.Fatal(err)
	}
	data := floats(22012/4, 9)
	sh := &Shard{Target: Target{Job: "job", Step: 1, Rank: 0, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
	m, err := w.WriteShard(context.Background(), sh)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Chunks) < 3 {
		t.Fatalf("%d chunks; the test wants several", len(m.Chunks))
	}
	if !m.Holds(sh) {
		t.Fatal("the stored copy of these very bytes is not recognised")
	}
	data[6] ^= 0xff // a gap byte: not tensor data
	if !m.Holds(sh) {
		t.Fatal("a byte between tensors changed the verdict")
	}
	data[20000] ^= 0xff // inside x
	if m.Holds(sh) {
		t.Fatal("other bytes were taken for the stored copy")
	}
}
