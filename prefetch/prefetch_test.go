package prefetch

import (
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

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// makeTar builds a WebDataset shard of n samples with a "cls" and a "txt"
// field each, keys "<shard>/<i>".
func makeTar(t testing.TB, shard string, n, payload int) []byte {
	t.Helper()
	var ms []tarMember
	for i := range n {
		key := fmt.Sprintf("%s/%06d", shard, i)
		ms = append(ms, tarMember{key + ".cls", []byte(fmt.Sprint(i % 10))},
			tarMember{key + ".txt", bytes.Repeat([]byte(key), payload/len(key)+1)[:payload]})
	}
	return tarOf(t, ms...)
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
	return keysOpts(t, b, c, spec, Options{})
}

func keysOpts(t *testing.T, b storage.Backend, c *Cache, spec Spec, opts Options) ([]string, Stats) {
	t.Helper()
	it, err := Open(context.Background(), b, "train/", c, spec, opts)
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
			ks, _ := keys(t, b, c, Spec{BatchSize: 5, Rank: rank, WorldSize: world, Seed: 1, Epoch: 2, ShuffleWindow: 10, Even: EvenOff})
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

// A damaged shard fails the epoch naming it; with skip_corrupt, the
// samples before the damage are delivered, the rest of the shard is
// skipped and counted, whether the shard is read whole or streamed.
func TestCorruptShard(t *testing.T) {
	b := dataset(t, 3, 5, 100)
	good := makeTar(t, "bad", 5, 100) // 2 KiB a sample
	for _, tc := range []struct {
		name, data string
		before     int // samples whole before the damage
	}{
		{"truncated", string(good[:len(good)/2+100]), 2},
		{"cut at a member", string(good[:3*2048+1024]), 3}, // the third sample's first member: it is dropped
		{"cut at the end", string(good[:5*2048]), 4},       // no end-of-archive marker: the last sample may be cut too
		{"garbage", strings.Repeat("not a tar file ", 100), 0},
	} {
		for _, opts := range []Options{{}, {ReadAheadBytes: minReadAhead}} { // whole, streamed
			shard := "train/zz-bad.tar"
			if err := b.Put(context.Background(), shard, strings.NewReader(tc.data), int64(len(tc.data))); err != nil {
				t.Fatal(err)
			}
			if opts.ReadAheadBytes != 0 && int64(len(tc.data)) <= minReadAhead/4 {
				// Make the bad shard larger than the streaming threshold: pad it
				// with bytes that are no tar header either.
				padded := tc.data + strings.Repeat("x", minReadAhead/4+1-len(tc.data))
				if err := b.Put(context.Background(), shard, strings.NewReader(padded), int64(len(padded))); err != nil {
					t.Fatal(err)
				}
			}
			it, err := Open(context.Background(), b, "train/", newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1}, opts)
			if err != nil {
				t.Fatal(err)
			}
			for {
				_, err = it.Next(context.Background())
				if err != nil {
					break
				}
			}
			it.Close()
			if !errors.Is(err, ErrCorruptShard) || !strings.Contains(err.Error(), shard) {
				t.Fatalf("%s %+v: got %v; want ErrCorruptShard naming the shard", tc.name, opts, err)
			}
			ks, st := keysOpts(t, b, newCache(t, 1<<20), Spec{BatchSize: 4, WorldSize: 1, SkipCorrupt: true}, opts)
			if st.CorruptSkipped != 1 || len(ks) != 15+tc.before {
				t.Fatalf("%s %+v: skip: %d samples, %+v; want %d", tc.name, opts, len(ks), st, 15+tc.before)
			}
		}
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
		{Spec{BatchSize: 1, WorldSize: 1, Format: "lance"}, "unknown format"},
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

// Whole shards and streamed ones are cut into the same members, with the
// same errors, whatever the bytes: the order of samples must not depend on
// which way a shard was read.
func FuzzWalkTar(f *testing.F) {
	f.Add(makeTar(f, "s", 3, 10))
	f.Add(makeTar(f, "s", 1, 1000)[:700])
	f.Add(makeTar(f, "s", 2, 100)[:1536])
	f.Add([]byte{})
	type got struct {
		name        string
		start, size int64
		data        string
	}
	walk := func(data []byte, stream bool) ([]got, error) {
		var out []got
		var r io.Reader
		var pos func() int64
		if stream {
			c := &counter{r: io.MultiReader(bytes.NewReader(data))} // not a Seeker
			r, pos = c, func() int64 { return c.n }
		} else {
			br := bytes.NewReader(data)
			r, pos = br, func() int64 { return int64(len(data)) - int64(br.Len()) }
		}
		err := walkTar(r, pos, int64(len(data)), func(m member) error {
			if m.start < 0 || m.start+m.size > int64(len(data)) {
				return fmt.Errorf("member %s at [%d,+%d) outside %d bytes", m.name, m.start, m.size, len(data))
			}
			read, err := io.ReadAll(m.r)
			if err != nil {
				return err
			}
			if !bytes.Equal(read, data[m.start:m.start+m.size]) {
				return fmt.Errorf("member %s: its bytes are not the shard's at its offset", m.name)
			}
			out = append(out, got{m.name, m.start, m.size, string(read)})
			return nil
		})
		return out, err
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		whole, werr := walk(data, false)
		streamed, serr := walk(data, true)
		if fmt.Sprint(werr) != fmt.Sprint(serr) || !slices.Equal(whole, streamed) {
			t.Fatalf("whole: %v, %v\nstreamed: %v, %v", len(whole), werr, len(streamed), serr)
		}
		if werr != nil && strings.Contains(werr.Error(), "outside") {
			t.Fatal(werr)
		}
	})
}

// A listing that would cost more than its budget stops with ErrTooLarge
// (naming the flag) as soon as it passes it; one that fits is whole.
func TestListShardsBudget(t *testing.T) {
	b := dataset(t, 10, 1, 10)
	all, err := ListShards(context.Background(), b, "train/", WebDataset, DefaultListBytes)
	if err != nil || len(all) != 10 {
		t.Fatalf("listing: %d shards, %v", len(all), err)
	}
	var cost int64
	for _, sh := range all {
		cost += listCost(sh.Name)
	}
	for _, tc := range []struct {
		budget int64
		ok     bool
	}{{cost, true}, {cost - 1, false}, {0, false}} {
		got, err := ListShards(context.Background(), b, "train/", WebDataset, tc.budget)
		switch {
		case tc.ok && (err != nil || len(got) != 10):
			t.Errorf("budget %d (exactly the cost): %d shards, %v", tc.budget, len(got), err)
		case !tc.ok && (!errors.Is(err, ErrTooLarge) || !ranInto(err, budget.DatasetListing) || got != nil):
			t.Errorf("budget %d (under the cost %d): %d shards, %v; want ErrTooLarge of the listing budget", tc.budget, cost, len(got), err)
		}
	}
}
