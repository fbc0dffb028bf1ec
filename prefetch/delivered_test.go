package prefetch

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
)

// eachBatch calls f with up to batches batches of it (all: -1).
func eachBatch(t *testing.T, it *Iterator, batches int, f func(*Batch)) {
	t.Helper()
	for n := 0; batches < 0 || n < batches; n++ {
		batch, err := it.Next(context.Background())
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		f(batch)
	}
}

// consume reads up to batches batches of one rank's epoch and returns the
// sample keys and the rank's delivered set at that point.
func consume(t *testing.T, it *Iterator, batches int) ([]string, *Delivered) {
	t.Helper()
	var keys []string
	var pos int64
	eachBatch(t, it, batches, func(batch *Batch) {
		for _, s := range batch.Samples {
			keys = append(keys, s.Key)
		}
		pos = batch.Position
	})
	d, err := it.Delivered(pos)
	if err != nil {
		t.Fatal(err)
	}
	return keys, d
}

// An epoch consumed in part by 4 ranks resumes at 3, 6 or 2 ranks (and
// again at another size) from the union of the ranks' delivered sets:
// every sample of the epoch is delivered exactly once over all phases.
func TestElasticResume(t *testing.T) {
	b := dataset(t, 12, 10, 100)
	for _, sizes := range [][]int{{4, 3}, {4, 6}, {4, 3, 2}, {2, 5, 1}} {
		c := newCache(t, 64<<20)
		seen := map[string]int{}
		var union *Delivered
		for phase, world := range sizes {
			last := phase == len(sizes)-1
			next := NewDelivered()
			for rank := range world {
				spec := Spec{BatchSize: 4, WorldSize: world, Rank: rank, Epoch: 2, Seed: 7, ShuffleWindow: 16, Even: EvenOff}
				if union != nil {
					spec.Delivered = union
				}
				it, err := Open(context.Background(), b, "train/", c, spec, Options{})
				if err != nil {
					t.Fatal(err)
				}
				batches := -1 // the last phase reads to the end
				if !last {
					batches = rank + 2
				}
				keys, d := consume(t, it, batches)
				it.Close()
				for _, k := range keys {
					seen[k]++
				}
				// Through the bytes trainers store.
				dd, err := DecodeDelivered(d.Encode())
				if err != nil || !bytes.Equal(dd.Encode(), d.Encode()) {
					t.Fatalf("round trip: %v", err)
				}
				next.Union(dd)
			}
			union = next
		}
		if len(seen) != 120 {
			t.Errorf("world sizes %v: %d distinct samples delivered, want 120", sizes, len(seen))
		}
		for k, n := range seen {
			if n != 1 {
				t.Errorf("world sizes %v: sample %s delivered %d times", sizes, k, n)
			}
		}
		if union.Count() != 120 {
			t.Errorf("world sizes %v: the final set holds %d samples", sizes, union.Count())
		}
	}
}

// Positions move forward and end where batches end; a start and a
// delivered set do not mix.
func TestDeliveredPositions(t *testing.T) {
	b := dataset(t, 2, 10, 100)
	it, err := Open(context.Background(), b, "train/", newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	for range 2 {
		if _, err := it.Next(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := it.Delivered(5); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a position inside a batch: %v", err)
	}
	if d, err := it.Delivered(8); err != nil || d.Count() != 8 {
		t.Fatalf("position 8: %v", err)
	}
	if _, err := it.Delivered(4); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a position gone back: %v", err)
	}
	// Resumed from a start, the samples skipped count as delivered.
	again, err := Open(context.Background(), b, "train/", newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1, Start: 8}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	batch, err := again.Next(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if d, err := again.Delivered(batch.Position); err != nil || d.Count() != 12 {
		t.Fatalf("after a resume at 8 and a batch of 4: %v", err)
	}
}

// A stored position is untrusted bytes: whatever they are, decoding
// refuses them or yields a set that encodes and decodes to itself.
func FuzzDecodeDelivered(f *testing.F) {
	d := NewDelivered()
	d.add("train/shard-000.tar", 3)
	d.add("train/shard-001.tar", 17)
	d.setTotal("train/shard-001.tar", 20)
	f.Add(d.Encode())
	f.Add([]byte("ckd1\x01\x02ab\x05\x01\xff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := DecodeDelivered(b)
		if err != nil {
			return
		}
		again, err := DecodeDelivered(d.Encode())
		if err != nil {
			t.Fatalf("re-decoding: %v", err)
		}
		if !bytes.Equal(again.Encode(), d.Encode()) {
			t.Fatal("not stable")
		}
		_ = d.Count()
	})
}

// A session nobody asks for its position keeps a bounded log: the batches
// beyond the last maxLogged are folded into the bitmaps, and positions
// inside the log still answer exactly.
func TestDeliveredLogBounded(t *testing.T) {
	b := dataset(t, 10, 10, 100)
	it, err := Open(context.Background(), b, "train/", newCache(t, 1<<20), Spec{BatchSize: 1, WorldSize: 1, ShuffleWindow: 1}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	for range 90 {
		if _, err := it.Next(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	it.mu.Lock()
	logged := len(it.log)
	it.mu.Unlock()
	if logged > maxLogged {
		t.Fatalf("%d batches logged, more than %d", logged, maxLogged)
	}
	if _, err := it.Delivered(10); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a position folded away: %v", err)
	}
	if d, err := it.Delivered(80); err != nil || d.Count() != 80 {
		t.Fatalf("position 80: %v", err)
	}
}
