package prefetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
)

// mappedDataset writes shards under dir/train as a local source (the
// daemon's backend for an allowed folder), and maps every shard above
// 1 KiB for the test.
func mappedDataset(t *testing.T, shards, perShard, payload int) (storage.Backend, string) {
	t.Helper()
	old := mapAbove
	mapAbove = 1 << 10
	t.Cleanup(func() { mapAbove = old })
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	writeDataset(t, filepath.Join(dir, "train"), shards, perShard, payload)
	allow, err := newAllowList([]string{dir}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := openLocal(dir, allow)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b, filepath.Join(dir, "train")
}

// mapped counts the areas of this process's address space that map files
// under dir.
func mapped(t *testing.T, dir string) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(maps), dir+"/")
}

// A local source's shards are mapped, not read: the cache's entries are
// the page cache's pages, the samples are the files' bytes, and a second
// epoch reads nothing from storage.
func TestMappedShardsAreDelivered(t *testing.T) {
	b, dir := mappedDataset(t, 6, 5, 3000)
	c := newCache(t, 64<<20)
	for epoch := range int64(2) {
		it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, WorldSize: 1, Epoch: epoch}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		eachBatch(t, it, -1, func(batch *Batch) {
			for _, s := range batch.Samples {
				checkSample(t, s, 3000)
				n++
			}
		})
		it.Close()
		if n != 30 {
			t.Fatalf("epoch %d: %d samples, want 30", epoch, n)
		}
	}
	if got := c.StorageReads(); got != 6 {
		t.Fatalf("%d storage reads over two epochs, want 6", got)
	}
	if got := mapped(t, dir); got != 6 {
		t.Fatalf("%d areas map the dataset's files, want its 6 shards (cached)", got)
	}
}

// checkSample checks a sample of makeTar's against what it wrote.
func checkSample(t *testing.T, s Sample, payload int) {
	t.Helper()
	for _, f := range s.Fields {
		if f.Name == "txt" {
			want := strings.Repeat(s.Key, payload/len(s.Key)+1)[:payload]
			if string(f.Data) != want {
				t.Fatalf("sample %s: txt field differs from the file's", s.Key)
			}
		}
	}
}

// A sample keeps its mapped shard mapped after the cache evicted it; once
// nothing refers to a mapping, it is unmapped.
func TestMappedShardOutlivesEviction(t *testing.T) {
	b, dir := mappedDataset(t, 4, 5, 3000)
	c := newCache(t, 64<<20)
	it, err := Open(context.Background(), b, "train/", c, Spec{BatchSize: 4, WorldSize: 1}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := it.Next(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	kept := batch.Samples[0]
	it.Close()
	c.Close() // drops every entry
	for range 3 {
		runtime.GC()
	}
	checkSample(t, kept, 3000) // still mapped: the sample holds it
	if got := mapped(t, dir); got < 1 {
		t.Fatalf("the kept sample's shard is not mapped any more")
	}
	kept = Sample{}
	deadline := time.Now().Add(testtime.Scale(30 * time.Second))
	for mapped(t, dir) > 0 || liveMappings.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d mappings left after everything was dropped", mapped(t, dir))
		}
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
}

// A shard truncated while the cache holds its mapping fails the epoch with
// ErrShardChanged (DATA_LOSS in the daemon) where its bytes are read,
// instead of crashing the daemon, and the cache forgets it.
func TestTruncatedMappedShard(t *testing.T) {
	b, dir := mappedDataset(t, 3, 20, 3000)
	c := newCache(t, 64<<20)
	spec := Spec{BatchSize: 4, WorldSize: 1, Epoch: 1, ShuffleWindow: 1}
	keys(t, b, c, spec) // every shard cached, mapped
	it, err := Open(context.Background(), b, "train/", c, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	if _, err := it.Next(context.Background()); err != nil { // the assembler is a few samples into the first shard
		t.Fatal(err)
	}
	order := ShardsForRank(mustList(t, b), 0, 1, 0, 1)
	last := order[len(order)-1]
	if err := os.Truncate(filepath.Join(dir, filepath.Base(last.Name)), 0); err != nil {
		t.Fatal(err)
	}
	for err == nil {
		_, err = it.Next(context.Background())
	}
	if !errors.Is(err, ErrShardChanged) || !errors.Is(err, ErrCorruptShard) {
		t.Fatalf("epoch over a truncated mapped shard: %v, want ErrShardChanged", err)
	}
	for _, sh := range order {
		_, cached := c.rc.Get(shardKey(b, sh))
		if want := sh.Name != last.Name; cached != want {
			t.Errorf("%s cached %v after the fault, want %v", sh.Name, cached, want)
		}
	}
	if c.adm.resident != 2*last.Size { // the three shards are the same size
		t.Errorf("admission books %d bytes after the fault, want the 2 shards still cached (%d)", c.adm.resident, 2*last.Size)
	}
}

func mustList(t *testing.T, b storage.Backend) []Shard {
	t.Helper()
	all, err := ListShards(context.Background(), b, "train/", WebDataset, DefaultListBytes)
	if err != nil {
		t.Fatal(err)
	}
	return all
}

// A batch whose samples alias a mapped shard truncated since is refused by
// the ring copy with ErrShardChanged, and the slot and turn it took are
// given back.
func TestRingCopyOfTruncatedShard(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "shard.tar")
	if err := os.WriteFile(path, make([]byte, 64<<10), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mapFile(f, 64<<10)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	s := newService(t, storage.Backend(nil), ServiceConfig{})
	r, err := newRing(context.Background(), s.arena, s.budget, 2, 2, 1<<20, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}
	b := &Batch{Samples: []Sample{{Key: "k", Fields: []Field{{Name: "bin", Data: m.data}}, keep: m}}}
	for range 3 { // the slot and the turn come back each time
		if _, err := r.Fill(context.Background(), b, func() {}); !errors.Is(err, ErrShardChanged) {
			t.Fatalf("ring copy of a truncated mapped shard: %v, want ErrShardChanged", err)
		}
	}
	if len(r.turns) != 0 || len(r.free) != 2 {
		t.Fatalf("after failed copies: %d turns taken, %d slots free; want 0 and 2", len(r.turns), len(r.free))
	}
}

// Past the cap on mappings, shards are read as before (the Go runtime
// keeps the areas it needs to grow the heap).
func TestMappingCapFallsBackToReading(t *testing.T) {
	b, _ := mappedDataset(t, 2, 5, 3000)
	sh := mustList(t, b)[0]
	liveMappings.Add(mappingCap())
	defer liveMappings.Add(-mappingCap())
	got, err := readShard(context.Background(), b, sh, nil)
	if err != nil || got.m.borrowed() || int64(len(got.b)) != sh.Size {
		t.Fatalf("at the cap: mapped %v, %d bytes, %v; want %d bytes read", got.m.borrowed(), len(got.b), err, sh.Size)
	}
	liveMappings.Add(-mappingCap())
	got, err = readShard(context.Background(), b, sh, nil)
	liveMappings.Add(mappingCap())
	if err != nil || !got.m.borrowed() {
		t.Fatalf("under the cap: mapped %v, %v; want mapped", got.m.borrowed(), err)
	}
}

// A raw object's sample is the object itself: of a mapped shard the cache
// does not hold (a cache too small for it), the sample gets its own copy,
// as a tar member's does, since nothing keeps the mapping alive for it.
func TestRawSampleOfUnheldMappedShard(t *testing.T) {
	old := mapAbove
	mapAbove = 1 << 10
	t.Cleanup(func() { mapAbove = old })
	dir, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{}
	for i := range 4 {
		data := []byte(strings.Repeat(string(rune('a'+i)), 64<<10))
		want[fmt.Sprintf("obj%d", i)] = data
		if err := os.MkdirAll(filepath.Join(dir, "raw"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "raw", fmt.Sprintf("obj%d.bin", i)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	allow, err := newAllowList([]string{dir}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := openLocal(dir, allow)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	c := newCache(t, 0) // holds nothing
	it, err := Open(context.Background(), b, "raw/", c, Spec{Format: Raw, BatchSize: 4, WorldSize: 1, ShuffleWindow: 1}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := it.Next(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	it.Close()
	deadline := time.Now().Add(testtime.Scale(30 * time.Second))
	for mapped(t, dir) > 0 && time.Now().Before(deadline) { // every mapping collected
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	for _, s := range batch.Samples {
		if got := s.Fields[0].Data; !bytes.Equal(got, want[s.Key]) {
			t.Fatalf("sample %s: %d bytes, not the object's", s.Key, len(got))
		}
	}
}
