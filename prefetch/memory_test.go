package prefetch

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// tarOf builds a tar of the given members, in order.
func tarOf(t testing.TB, members ...tarMember) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range members {
		if err := tw.WriteHeader(&tar.Header{Name: m.name, Mode: 0o644, Size: int64(len(m.data))}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(m.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type tarMember struct {
	name string
	data []byte
}

// sizedDataset writes shards of samples whose "bin" field sizes are drawn
// (reproducibly) between lo and hi bytes, into a new backend's "train/";
// shard s has per samples, or per×(s+1) when grow is set.
func sizedDataset(t *testing.T, shards, per int, lo, hi int, grow ...bool) storage.Backend {
	t.Helper()
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	for s := range shards {
		var ms []tarMember
		n := per
		if len(grow) > 0 {
			n = per * (s + 1)
		}
		for i := range n {
			key := fmt.Sprintf("s%03d/%05d", s, i)
			n := lo + rng.IntN(hi-lo+1)
			ms = append(ms, tarMember{key + ".bin", bytes.Repeat([]byte{byte(i)}, n)}, tarMember{key + ".cls", []byte{byte(s)}})
		}
		writeFile(t, filepath.Join(dir, "train", fmt.Sprintf("shard-%03d.tar", s)), tarOf(t, ms...))
	}
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t testing.TB, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

// epochOf reads a whole epoch and returns the keys in order, the stats
// and the iterator (closed) for its meters. The consumer is slow, so that
// the producer runs as far ahead as the budget lets it.
func epochOf(t *testing.T, b storage.Backend, c *Cache, spec Spec, opts Options) ([]string, Stats, *Iterator, error) {
	t.Helper()
	it, err := Open(context.Background(), b, "train/", c, spec, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var out []string
	for n := 0; ; n++ {
		batch, err := it.Next(context.Background())
		if errors.Is(err, io.EOF) {
			return out, it.Stats(), it, nil
		}
		if err != nil {
			return out, it.Stats(), it, err
		}
		for _, s := range batch.Samples {
			if bin := s.Fields[0].Data; len(bin) > 0 && bin[0] != bin[len(bin)-1] {
				t.Fatalf("sample %s: wrong bytes", s.Key)
			}
			out = append(out, s.Key)
		}
		if n%8 == 0 {
			time.Sleep(time.Millisecond)
		}
	}
}

// Every byte an iteration holds is charged to its read-ahead budget, and
// the budget holds: large samples, a large window, shards cached, not
// cached, read whole or streamed.
func TestReadAheadBudgetHolds(t *testing.T) {
	b := sizedDataset(t, 6, 4, 20<<10, 120<<10, true) // shards of 280 KiB to 1.7 MiB
	const ra = 4 << 20                                // window 2 MiB, batches 1 MiB, shards 1 MiB, streamed above 512 KiB
	for _, cacheBytes := range []int64{0, 64 << 20} {
		c := newCache(t, cacheBytes)
		for epoch := range int64(2) { // the second from the cache, if any
			spec := Spec{BatchSize: 8, WorldSize: 1, Epoch: epoch, ShuffleWindow: 10000}
			ks, st, it, err := epochOf(t, b, c, spec, Options{ReadAheadBytes: ra})
			if err != nil {
				t.Fatal(err)
			}
			if len(ks) != 84 || len(slices.Compact(slices.Sorted(slices.Values(ks)))) != 84 {
				t.Fatalf("%d samples, want 84 once each", len(ks))
			}
			if p := it.samplesMem.peak.Load(); p > ra*3/4 || p < ra/2 {
				t.Fatalf("cache %d epoch %d: samples held %d bytes at the peak; want at most %d (and the window to fill)", cacheBytes, epoch, p, ra*3/4)
			}
			if p := it.shardsMem.peak.Load(); p > ra/4 || p == 0 {
				t.Fatalf("shards read ahead: %d bytes at the peak, want some and at most %d", p, ra/4)
			}
			if it.samplesMem.used.Load() != 0 {
				t.Fatalf("%d bytes still charged after the epoch", it.samplesMem.used.Load())
			}
			t.Logf("cache %d epoch %d: %+v, peaks: samples %d, shards %d", cacheBytes, epoch, st, it.samplesMem.peak.Load(), it.shardsMem.peak.Load())
		}
	}
}

// The window is bounded by bytes deterministically: the order is a
// function of the samples and the budget, the same every time, and a
// resume replays the tail exactly.
func TestByteBoundedWindowIsDeterministic(t *testing.T) {
	b := sizedDataset(t, 4, 30, 10<<10, 100<<10)
	spec := Spec{BatchSize: 5, WorldSize: 1, Seed: 3, ShuffleWindow: 1000}
	opts := Options{ReadAheadBytes: 2 << 20} // a 1 MiB window: ~20 samples
	full, _, _, err := epochOf(t, b, newCache(t, 0), spec, opts)
	if err != nil {
		t.Fatal(err)
	}
	cached := newCache(t, 64<<20)
	for _, start := range []int64{0, 0, 1, 17, 60, 119, 120} {
		spec.Start = start
		c := newCache(t, 0)
		if start%2 == 0 {
			c = cached // aliased samples or copies: the same order
		}
		tail, _, _, err := epochOf(t, b, c, spec, opts)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(tail, full[start:]) {
			t.Fatalf("start %d: not the tail of the epoch", start)
		}
	}
}

// While the byte bound does not bind, the order is the count-bounded
// window's, whether shards are read whole or streamed.
func TestStreamedShardsKeepTheOrder(t *testing.T) {
	b := sizedDataset(t, 5, 300, 900, 1100) // shards of ~450 KiB, samples of ~2 KiB
	spec := Spec{BatchSize: 7, WorldSize: 1, Seed: 9, ShuffleWindow: 50}
	whole, st, _, err := epochOf(t, b, newCache(t, 64<<20), spec, Options{})
	if err != nil || st.CacheMisses != 5 {
		t.Fatal(err, st)
	}
	c := newCache(t, 64<<20)
	streamed, st, _, err := epochOf(t, b, c, spec, Options{ReadAheadBytes: minReadAhead}) // streams above 256 KiB
	if err != nil || !slices.Equal(whole, streamed) {
		t.Fatalf("streamed: %v; same order: %v", err, slices.Equal(whole, streamed))
	}
	if c.StorageReads() != 0 || st.CacheMisses != 5 {
		t.Fatalf("streamed shards went through the cache: %d reads, %+v", c.StorageReads(), st)
	}
}

func TestSampleLargerThanTheBudget(t *testing.T) {
	dir := t.TempDir()
	big := bytes.Repeat([]byte{7}, 700<<10)
	writeFile(t, filepath.Join(dir, "train", "a.tar"), tarOf(t,
		tarMember{"x/0.bin", []byte{1}}, tarMember{"x/1.bin", big}, tarMember{"x/1.cls", []byte{1}}, tarMember{"x/2.bin", []byte{2}}))
	var b storage.Backend
	b, _ = posix.New(dir)
	opts := Options{ReadAheadBytes: minReadAhead} // 256 KiB for a batch
	_, _, _, err := epochOf(t, b, newCache(t, 0), Spec{BatchSize: 1, WorldSize: 1}, opts)
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "x/1") || !ranInto(err, budget.ReadAhead) {
		t.Fatalf("a 700 KiB sample with 256 KiB for a batch: %v", err)
	}
	ks, st, _, err := epochOf(t, b, newCache(t, 0), Spec{BatchSize: 1, WorldSize: 1, SkipCorrupt: true}, opts)
	if err != nil || len(ks) != 2 || st.CorruptSkipped != 1 {
		t.Fatalf("skip_corrupt: %v, %v, %+v", err, ks, st)
	}
	// A batch that cannot fit is an error naming batch_size.
	b = sizedDataset(t, 1, 20, 100<<10, 100<<10)
	_, _, _, err = epochOf(t, b, newCache(t, 0), Spec{BatchSize: 10, WorldSize: 1}, opts)
	if !errors.Is(err, ErrTooLarge) || !strings.Contains(err.Error(), "batch_size") {
		t.Fatalf("a 1 MiB batch with 256 KiB for a batch: %v", err)
	}
}

// Keys and field names travel as protobuf strings: a sample whose names
// are not UTF-8 is refused, never delivered (and never breaks a batch).
func TestNamesThatAreNotUTF8(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "train", "a.tar"), tarOf(t,
		tarMember{"ok/0.txt", []byte("a")},
		tarMember{"bad\xff/1.txt", []byte("b")}, tarMember{"bad\xff/1.cls", []byte("1")},
		tarMember{"ok/2.txt", []byte("c")}, tarMember{"ok/2.j\xfeg", []byte("c")},
		tarMember{"ok/3.txt", []byte("d")}))
	b, _ := posix.New(dir)
	for _, opts := range []Options{{}, {ReadAheadBytes: minReadAhead}} {
		_, _, _, err := epochOf(t, b, newCache(t, 0), Spec{BatchSize: 1, WorldSize: 1, ShuffleWindow: 1}, opts)
		if !errors.Is(err, ErrCorruptShard) || !strings.Contains(err.Error(), "train/a.tar") ||
			!strings.Contains(err.Error(), `"bad\xff/1.txt"`) || !strings.Contains(err.Error(), "not UTF-8") {
			t.Fatalf("%+v: %v", opts, err)
		}
		ks, st, _, err := epochOf(t, b, newCache(t, 0), Spec{BatchSize: 1, WorldSize: 1, ShuffleWindow: 1, SkipCorrupt: true}, opts)
		if err != nil || !slices.Equal(ks, []string{"ok/0", "ok/3"}) || st.CorruptSkipped != 2 {
			t.Fatalf("%+v: skip_corrupt: %v, %q, %+v", opts, err, ks, st)
		}
	}
	// A raw object's name too.
	writeFile(t, filepath.Join(dir, "raw", "x\xff.bin"), []byte("x"))
	writeFile(t, filepath.Join(dir, "raw", "y.bin"), []byte("y"))
	it, err := Open(context.Background(), b, "raw/", newCache(t, 0), Spec{Format: Raw, BatchSize: 5, WorldSize: 1, SkipCorrupt: true}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	batch, err := it.Next(context.Background())
	if err != nil || len(batch.Samples) != 1 || batch.Samples[0].Key != "y" || it.Stats().CorruptSkipped != 1 {
		t.Fatalf("raw: %v, %+v", err, batch)
	}
}

// An iteration that stops leaves no shard read running.
func TestStoppedIterationsLeaveNoReads(t *testing.T) {
	b := dataset(t, 20, 10, 10_000)
	c := newCache(t, 0)
	for i := range 50 {
		it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, WorldSize: 1, Seed: uint64(i)}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		it.Close()
	}
	deadline := time.Now().Add(testtime.Scale(30 * time.Second))
	for {
		c.mu.Lock()
		n := len(c.fills)
		c.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d shard reads still running for closed iterations", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A wait for the datasets' share ends before the caller's deadline with a
// refusal naming the budget, not with the deadline itself (which races
// the caller's cancelling the call).
func TestBudgetWaitEndsBeforeTheCallersDeadline(t *testing.T) {
	b := newArenaBudget(1 << 20)
	if err := b.acquire(context.Background(), 1<<20, time.Second, "the first ring"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(2*time.Second))
	defer cancel()
	err := b.acquire(ctx, 1<<20, time.Minute, "a second ring")
	if !errors.Is(err, ErrOverBudget) || ctx.Err() != nil {
		t.Fatalf("acquire past a full share: %v (caller's context: %v), want ErrOverBudget before the deadline", err, ctx.Err())
	}
}
