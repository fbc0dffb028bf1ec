package prefetch

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// makeTar builds a WebDataset shard of n samples with a "cls" and a "txt"
// field each, keys "<shard>/<i>".
func makeTar(t testing.TB, shard string, n, payload int) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for i := range n {
		key := fmt.Sprintf("%s/%06d", shard, i)
		for _, f := range []struct {
			ext  string
			data []byte
		}{{"cls", []byte(fmt.Sprint(i % 10))}, {"txt", bytes.Repeat([]byte(key), payload/len(key)+1)[:payload]}} {
			if err := tw.WriteHeader(&tar.Header{Name: key + "." + f.ext, Mode: 0o644, Size: int64(len(f.data))}); err != nil {
				t.Fatal(err)
			}
			if _, err := tw.Write(f.data); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// dataset writes shards×perShard samples under "train/" of a new backend.
func dataset(t *testing.T, shards, perShard, payload int) storage.Backend {
	t.Helper()
	dir := t.TempDir()
	writeDataset(t, filepath.Join(dir, "train"), shards, perShard, payload)
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// writeDataset writes shards×perShard samples into dir.
func writeDataset(t *testing.T, dir string, shards, perShard, payload int) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for s := range shards {
		name := fmt.Sprintf("shard-%03d", s)
		if err := os.WriteFile(filepath.Join(dir, name+".tar"), makeTar(t, name, perShard, payload), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func newCache(t *testing.T, budget int64) *Cache {
	c, err := NewCache(budget)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// keys iterates one rank's epoch and returns the sample keys in order.
func keys(t *testing.T, b storage.Backend, c *Cache, spec Spec) ([]string, Stats) {
	t.Helper()
	it, err := Open(context.Background(), b, "train/", c, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var out []string
	for {
		batch, err := it.Next(context.Background())
		if errors.Is(err, io.EOF) {
			return out, it.Stats()
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(batch.Samples) > spec.BatchSize {
			t.Fatalf("batch of %d > %d", len(batch.Samples), spec.BatchSize)
		}
		for _, s := range batch.Samples {
			if len(s.Fields) != 2 || s.Fields[0].Name != "cls" || s.Fields[1].Name != "txt" {
				t.Fatalf("sample %s fields %v", s.Key, s.Fields)
			}
			out = append(out, s.Key)
		}
		if batch.Position != spec.Start+int64(len(out)) {
			t.Fatalf("position %d after %d samples from %d", batch.Position, len(out), spec.Start)
		}
	}
}

func TestExactlyOncePerEpochAcrossRanks(t *testing.T) {
	b := dataset(t, 7, 13, 100)
	c := newCache(t, 64<<20)
	for _, world := range []int{1, 3, 8} {
		var all []string
		for rank := range world {
			ks, _ := keys(t, b, c, Spec{BatchSize: 5, Rank: rank, WorldSize: world, Seed: 1, Epoch: 2, ShuffleWindow: 10})
			all = append(all, ks...)
		}
		slices.Sort(all)
		if len(all) != 7*13 || len(slices.Compact(all)) != 7*13 {
			t.Fatalf("world %d: %d samples delivered, %d distinct; want 91 once each", world, len(all), len(slices.Compact(all)))
		}
	}
}

func TestOrderIsAFunctionOfSeedEpochRank(t *testing.T) {
	b := dataset(t, 6, 20, 10)
	c := newCache(t, 64<<20)
	spec := Spec{BatchSize: 4, Rank: 1, WorldSize: 2, Seed: 7, Epoch: 0, ShuffleWindow: 16}
	a, _ := keys(t, b, c, spec)
	again, _ := keys(t, b, c, spec)
	if !slices.Equal(a, again) {
		t.Fatal("same seed and epoch gave different orders")
	}
	spec.Epoch = 1
	other, _ := keys(t, b, c, spec)
	if slices.Equal(a, other) {
		t.Fatal("a new epoch gave the same order")
	}
	spec.Epoch, spec.Seed = 0, 8
	if other, _ = keys(t, b, c, spec); slices.Equal(a, other) {
		t.Fatal("another seed gave the same order")
	}
}

func TestResumeEqualsTail(t *testing.T) {
	b := dataset(t, 5, 17, 10)
	c := newCache(t, 64<<20)
	spec := Spec{BatchSize: 6, Rank: 0, WorldSize: 2, Seed: 3, Epoch: 4, ShuffleWindow: 9}
	full, _ := keys(t, b, c, spec)
	for _, k := range []int64{0, 1, 6, 13, int64(len(full)) - 1, int64(len(full)), int64(len(full)) + 5} {
		spec.Start = k
		tail, _ := keys(t, b, c, spec)
		want := full[min(k, int64(len(full))):]
		if !slices.Equal(tail, want) {
			t.Fatalf("resume at %d: %d samples, want %d (the tail)", k, len(tail), len(want))
		}
	}
}

func TestSecondEpochFromCache(t *testing.T) {
	b := dataset(t, 8, 10, 1000)
	c := newCache(t, 64<<20)
	_, first := keys(t, b, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: 0})
	reads := c.StorageReads()
	_, second := keys(t, b, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: 1})
	if first.CacheMisses != 8 || second.CacheHits != 8 || second.CacheMisses != 0 || c.StorageReads() != reads {
		t.Fatalf("epoch 1 %+v, epoch 2 %+v, storage reads %d then %d", first, second, reads, c.StorageReads())
	}
}

// A dataset larger than the budget keeps a stable cached subset rather
// than thrashing: from the second epoch on, every epoch hits about the
// fraction of shards that fit, the best any policy can do for scans.
func TestLargerThanCacheDoesNotThrash(t *testing.T) {
	for _, tc := range []struct{ shards, fit int }{{40, 20}, {40, 10}} {
		b := dataset(t, tc.shards, 10, 10_000)
		size := shardSize(t, b)
		c := newCache(t, int64(tc.fit)*size)
		for epoch := range int64(4) {
			_, st := keys(t, b, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: epoch})
			t.Logf("%d shards, %d fit: epoch %d: %d hits", tc.shards, tc.fit, epoch, st.CacheHits)
			if epoch > 0 && st.CacheHits < int64(tc.fit)*9/10 {
				t.Errorf("%d shards, %d fit: epoch %d hit %d shards, want about %d", tc.shards, tc.fit, epoch, st.CacheHits, tc.fit)
			}
		}
	}
}

// A full cache that nobody hits any more (its dataset is done) lets the
// shards of the dataset now being read displace it.
func TestStaleCacheAdmitsNewShards(t *testing.T) {
	old, cur := dataset(t, 10, 10, 10_000), dataset(t, 10, 10, 10_000)
	c := newCache(t, 10*shardSize(t, old))
	c.adm.staleAfter = 100 * time.Millisecond
	keys(t, old, c, Spec{BatchSize: 8, WorldSize: 1})
	keys(t, old, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: 1}) // full and hit
	if _, st := keys(t, cur, c, Spec{BatchSize: 8, WorldSize: 1}); st.CacheHits != 0 {
		t.Fatalf("a new dataset hit %d shards of another", st.CacheHits)
	}
	time.Sleep(2 * c.adm.staleAfter)
	keys(t, cur, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: 1}) // admitted now
	if _, st := keys(t, cur, c, Spec{BatchSize: 8, WorldSize: 1, Epoch: 2}); st.CacheHits != 10 {
		t.Fatalf("epoch 2 of a dataset that fits hit %d of 10 shards: its unused predecessor was not displaced", st.CacheHits)
	}
}

// shardSize is the size of the dataset's shards (all alike).
func shardSize(t *testing.T, b storage.Backend) int64 {
	t.Helper()
	var size int64
	err := b.List(context.Background(), "train/", func(oi storage.ObjectInfo) error {
		size = max(size, oi.Size)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return size
}

func TestCorruptShard(t *testing.T) {
	b := dataset(t, 3, 5, 100)
	good := makeTar(t, "bad", 5, 100)
	for _, tc := range []struct{ name, data string }{
		{"truncated", string(good[:len(good)/2+100])},
		{"garbage", strings.Repeat("not a tar file ", 100)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := b.Put(context.Background(), "train/zz-bad.tar", strings.NewReader(tc.data), int64(len(tc.data))); err != nil {
				t.Fatal(err)
			}
			it, err := Open(context.Background(), b, "train/", newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1}, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer it.Close()
			for {
				_, err = it.Next(context.Background())
				if err != nil {
					break
				}
			}
			if !errors.Is(err, ErrCorruptShard) || !strings.Contains(err.Error(), "train/zz-bad.tar") {
				t.Fatalf("got %v; want ErrCorruptShard naming the shard", err)
			}
			ks, st := keys(t, b, newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, SkipCorrupt: true})
			if st.CorruptSkipped != 1 || len(ks) != 15 {
				t.Fatalf("skip: %d samples, %+v", len(ks), st)
			}
		})
	}
}

func TestBadSpecs(t *testing.T) {
	b := dataset(t, 1, 1, 1)
	for _, tc := range []struct {
		spec Spec
		want string
	}{
		{Spec{BatchSize: 0, WorldSize: 1}, "batch_size"},
		{Spec{BatchSize: 1, WorldSize: 2, Rank: 2}, "rank 2 out of range"},
		{Spec{BatchSize: 1, WorldSize: 0}, "world_size"},
		{Spec{BatchSize: 1, WorldSize: 1, Format: "parquet"}, "unknown format"},
		{Spec{BatchSize: 1, WorldSize: 1, Start: -1}, "negative"},
	} {
		_, err := Open(context.Background(), b, "train/", newCache(t, 0), tc.spec, Options{})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.spec, err, tc.want)
		}
	}
	_, err := Open(context.Background(), b, "nothing/", newCache(t, 0), Spec{BatchSize: 1, WorldSize: 1}, Options{})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no .tar shards") {
		t.Errorf("empty prefix: %v", err)
	}
}

func TestRawFormat(t *testing.T) {
	dir := t.TempDir()
	for i, name := range []string{"a.jpg", "b.jpg", "sub/c.bin", "d"} {
		p := filepath.Join(dir, "raw", name)
		_ = os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := posix.New(dir)
	it, err := Open(context.Background(), b, "raw/", newCache(t, 1<<20), Spec{Format: Raw, BatchSize: 10, WorldSize: 1, ShuffleWindow: 1}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	batch, err := it.Next(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range batch.Samples {
		got = append(got, s.Key+"."+s.Fields[0].Name)
	}
	slices.Sort(got)
	if strings.Join(got, " ") != "a.jpg b.jpg d.bin sub/c.bin" {
		t.Fatalf("raw samples %v", got)
	}
}

func FuzzParseTar(f *testing.F) {
	f.Add(makeTar(f, "s", 3, 10))
	f.Add(makeTar(f, "s", 1, 1000)[:700])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		samples, err := parseTar(data)
		if err != nil {
			return
		}
		for _, s := range samples {
			for _, fl := range s.Fields {
				if len(fl.Data) > len(data) {
					t.Fatalf("field of %d bytes from %d bytes of tar", len(fl.Data), len(data))
				}
			}
		}
	})
}
