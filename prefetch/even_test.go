package prefetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// unevenDataset writes shards holding the given sample counts under
// "train/", so that ranks dealt whole shards get different counts.
func unevenDataset(t *testing.T, counts ...int) storage.Backend {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "train"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i, n := range counts {
		name := fmt.Sprintf("shard-%03d", i)
		if err := os.WriteFile(filepath.Join(dir, "train", name+".tar"), makeTar(t, name, n, 50), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

var unevenCounts = []int{30, 7, 19, 25, 3, 41, 12, 16, 9, 22}

func total(counts []int) int {
	n := 0
	for _, c := range counts {
		n += c
	}
	return n
}

// Every rank of an even epoch delivers the same count: the most any rank
// holds (pad: the others repeat samples, counted as padding and left out
// of their positions) or the fewest (drop); off keeps the deal's counts.
func TestEvenEpochsGiveEveryRankTheSameCount(t *testing.T) {
	b := unevenDataset(t, unevenCounts...)
	const world = 3
	c := newCache(t, 64<<20)
	counts := map[Even][]int{}
	for _, even := range []Even{EvenPad, EvenDrop, EvenOff} {
		seen := map[string]int{}
		var padded int64
		for rank := range world {
			spec := Spec{BatchSize: 4, Rank: rank, WorldSize: world, Seed: 5, Epoch: 1, ShuffleWindow: 8, Even: even}
			it, err := Open(context.Background(), b, "train/", c, spec, Options{})
			if err != nil {
				t.Fatal(err)
			}
			ks, d := consume(t, it, -1)
			st := it.Stats()
			it.Close()
			counts[even] = append(counts[even], len(ks))
			padded += st.Padded
			if int64(len(ks))-st.Padded != d.Count() {
				t.Errorf("%s rank %d: %d samples, %d padding, but its position holds %d", even, rank, len(ks), st.Padded, d.Count())
			}
			for _, k := range ks {
				seen[k]++
			}
		}
		repeats := 0
		for _, n := range seen {
			repeats += n - 1
		}
		switch even {
		case EvenPad:
			if len(seen) != total(unevenCounts) || int64(repeats) != padded || padded == 0 {
				t.Errorf("pad: %d distinct of %d, %d repeats, %d padded", len(seen), total(unevenCounts), repeats, padded)
			}
		case EvenDrop:
			if repeats != 0 || padded != 0 || len(seen) >= total(unevenCounts) {
				t.Errorf("drop: %d distinct of %d, %d repeats, %d padded", len(seen), total(unevenCounts), repeats, padded)
			}
		case EvenOff:
			if repeats != 0 || len(seen) != total(unevenCounts) {
				t.Errorf("off: %d distinct of %d, %d repeats", len(seen), total(unevenCounts), repeats)
			}
		}
	}
	off := counts[EvenOff]
	if slices.Min(off) == slices.Max(off) {
		t.Fatalf("the deal is even without help (%v): the test shows nothing", off)
	}
	for _, even := range []Even{EvenPad, EvenDrop} {
		want := slices.Max(off)
		if even == EvenDrop {
			want = slices.Min(off)
		}
		for rank, n := range counts[even] {
			if n != want {
				t.Errorf("%s: rank %d delivered %d samples, want %d (off: %v)", even, rank, n, want, off)
			}
		}
	}
}

// A rank without a shard (more ranks than shards) is padded to the
// others' count; with drop it would make every rank deliver nothing,
// which opening refuses.
func TestEvenWithMoreRanksThanShards(t *testing.T) {
	b := unevenDataset(t, 5, 3)
	c := newCache(t, 64<<20)
	for rank := range 4 {
		ks, st := keys(t, b, c, Spec{BatchSize: 2, Rank: rank, WorldSize: 4, ShuffleWindow: 1})
		if len(ks) != 5 {
			t.Errorf("rank %d: %d samples (%d padding), want 5", rank, len(ks), st.Padded)
		}
	}
	_, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 2, Rank: 0, WorldSize: 4, Even: EvenDrop}, Options{})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "at least as many shards as ranks") {
		t.Fatalf("drop with 2 shards for 4 ranks: %v", err)
	}
}

// An even epoch resumed at another world size from its ranks' positions
// delivers every sample not delivered yet exactly once (padding aside),
// again the same count on every rank.
func TestEvenElasticResume(t *testing.T) {
	b := unevenDataset(t, unevenCounts...)
	c := newCache(t, 64<<20)
	seen := map[string]int{}
	union := NewDelivered()
	for rank := range 4 {
		it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 4, Seed: 2, ShuffleWindow: 8}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		ks, d := consume(t, it, rank+3)
		it.Close()
		for _, k := range ks {
			seen[k]++
		}
		union.Union(d)
	}
	var counts []int
	var padded int64
	for rank := range 3 {
		it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 3, Seed: 2, ShuffleWindow: 8, Delivered: union}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		ks, _ := consume(t, it, -1)
		padded += it.Stats().Padded
		it.Close()
		counts = append(counts, len(ks))
		for _, k := range ks {
			seen[k]++
		}
	}
	if slices.Min(counts) != slices.Max(counts) {
		t.Errorf("resumed at 3 ranks: counts %v", counts)
	}
	repeats := 0
	for _, n := range seen {
		repeats += n - 1
	}
	if len(seen) != total(unevenCounts) || int64(repeats) != padded {
		t.Errorf("%d distinct of %d, %d repeats, %d padded", len(seen), total(unevenCounts), repeats, padded)
	}
}

// countSamples reads a tar's headers, not its data, and counts samples
// as the assembler cuts them; a shard damaged part way counts those
// before the damage.
func TestCountSamples(t *testing.T) {
	dir := t.TempDir()
	whole := makeTar(t, "a", 4, 3<<19) // 1.5 MiB members: skipped, not read
	cut := whole[:len(whole)/2]
	for name, data := range map[string][]byte{"whole.tar": whole, "cut.tar": cut} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	counting := &readCounter{Backend: b}
	n, err := countSamples(context.Background(), counting, Shard{Name: "whole.tar", Size: int64(len(whole))})
	if err != nil || n != 4 {
		t.Fatalf("whole: %d, %v; want 4", n, err)
	}
	if counting.read > int64(len(whole))/4 {
		t.Errorf("counting read %d bytes of a %d-byte shard", counting.read, len(whole))
	}
	c := newCache(t, 0)
	_, st := keysOf(t, b, c, "cut.tar", len(cut))
	n, err = countSamples(context.Background(), b, Shard{Name: "cut.tar", Size: int64(len(cut))})
	if err != nil || n != st {
		t.Fatalf("cut: counted %d, %v; the assembler delivers %d", n, err, st)
	}
}

// keysOf is how many samples an epoch over the one shard name delivers
// with skip_corrupt.
func keysOf(t *testing.T, b storage.Backend, c *Cache, name string, size int) ([]string, int) {
	t.Helper()
	it, err := Open(context.Background(), &oneShard{b, name}, "", c, Spec{BatchSize: 1, WorldSize: 1, ShuffleWindow: 1, SkipCorrupt: true}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var ks []string
	for {
		batch, err := it.Next(context.Background())
		if errors.Is(err, io.EOF) {
			return ks, len(ks)
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range batch.Samples {
			ks = append(ks, s.Key)
		}
	}
}

// oneShard lists only one object of a backend.
type oneShard struct {
	storage.Backend
	name string
}

func (o *oneShard) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	return o.Backend.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		if oi.Name != o.name {
			return nil
		}
		return fn(oi)
	})
}

// readCounter counts the bytes read through it.
type readCounter struct {
	storage.Backend
	read int64
}

func (c *readCounter) Get(ctx context.Context, name string, off, n int64) (io.ReadCloser, error) {
	rc, err := c.Backend.Get(ctx, name, off, n)
	if err != nil {
		return nil, err
	}
	return &readCounterReader{rc, c}, nil
}

type readCounterReader struct {
	io.ReadCloser
	c *readCounter
}

func (r *readCounterReader) Read(p []byte) (int, error) {
	n, err := r.ReadCloser.Read(p)
	r.c.read += int64(n)
	return n, err
}

// Each batch's samples, as a position, add up to what the session's
// Delivered says: padding is in neither.
func TestBatchDeliveredAddsUpToThePosition(t *testing.T) {
	b := unevenDataset(t, unevenCounts...)
	c := newCache(t, 64<<20)
	var padded int64
	for rank := range 3 {
		it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 3, ShuffleWindow: 8, BatchDelivered: true}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		sum := NewDelivered()
		var pos int64
		for {
			batch, err := it.Next(context.Background())
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			d, err := DecodeDelivered(it.batchDelivered(batch))
			if err != nil {
				t.Fatal(err)
			}
			sum.Union(d)
			pos = batch.Position
		}
		want, err := it.Delivered(pos)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(sum.Encode()); got != string(want.Encode()) {
			t.Fatalf("rank %d: the batches' positions hold %d samples, the session's %d", rank, sum.Count(), want.Count())
		}
		padded += it.Stats().Padded
		it.Close()
	}
	if padded == 0 {
		t.Fatal("no rank was padded: the test shows nothing")
	}
}
