package prefetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
)

// diskFiles lists the tier's files and its temporaries.
func diskFiles(t *testing.T, dir string) (shards, temps []string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		switch {
		case strings.HasSuffix(e.Name(), diskSuffix):
			shards = append(shards, filepath.Join(dir, e.Name()))
		case strings.HasSuffix(e.Name(), diskTemp):
			temps = append(temps, filepath.Join(dir, e.Name()))
		}
	}
	slices.Sort(shards)
	return shards, temps
}

// withDisk is a cache of no memory over the disk tier in dir, as a daemon
// started on it would have.
func withDisk(t *testing.T, dir string, budget int64) *Cache {
	t.Helper()
	c, err := NewCache(0)
	if err != nil {
		t.Fatal(err)
	}
	if c.disk, err = newDiskCache(dir, budget, slog.Default()); err != nil {
		t.Fatal(err)
	}
	return c
}

// Shards read from a store that is not local are kept on disk and read
// from there by the next daemon (a restart: the memory cache is empty); a
// file cut or damaged on the disk, or left half written by a crash, is
// never served: the shard is read from the store again.
func TestDiskTierServesWhatTheStoreGave(t *testing.T) {
	b := dataset(t, 6, 10, 2000) // a posix.Backend: not a local source, so "remote"
	dir := t.TempDir()
	spec := Spec{BatchSize: 7, WorldSize: 1, Seed: 1, ShuffleWindow: 1}

	c := withDisk(t, dir, 64<<20)
	want, _ := keys(t, b, c, spec)
	c.Close() // waits for the writes
	files, _ := diskFiles(t, dir)
	if c.StorageReads() != 6 || c.DiskHits() != 0 || len(files) != 6 {
		t.Fatalf("first epoch: %d storage reads, %d disk hits, %d files; want 6, 0, 6", c.StorageReads(), c.DiskHits(), len(files))
	}

	c = withDisk(t, dir, 64<<20)
	got, _ := keys(t, b, c, spec)
	c.Close()
	if !slices.Equal(got, want) || c.StorageReads() != 0 || c.DiskHits() != 6 {
		t.Fatalf("after a restart: %d storage reads, %d disk hits (same samples: %v); want all from disk", c.StorageReads(), c.DiskHits(), slices.Equal(got, want))
	}

	// A crash's temporary, a file cut short, a file whose bytes changed.
	writeFile(t, filepath.Join(dir, "123"+diskTemp), []byte("half a shard"))
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, files[0], data[:len(data)-3])
	data, err = os.ReadFile(files[1])
	if err != nil {
		t.Fatal(err)
	}
	data[100] ^= 1
	writeFile(t, files[1], data)
	c = withDisk(t, dir, 64<<20)
	if _, temps := diskFiles(t, dir); len(temps) != 0 {
		t.Fatalf("a crash's temporaries are left: %v", temps)
	}
	got, _ = keys(t, b, c, spec)
	c.Close()
	if !slices.Equal(got, want) || c.StorageReads() != 2 || c.DiskHits() != 4 {
		t.Fatalf("with 2 damaged files: %d storage reads, %d disk hits; want 2 and 4", c.StorageReads(), c.DiskHits())
	}

	// A shard rewritten in the store (another size or time) is another
	// file: its old bytes are not served.
	shard := filepath.Join(b.Location()[len("file://"):], "train", "shard-000.tar")
	if err := os.Chtimes(shard, time.Now(), time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	c = withDisk(t, dir, 64<<20)
	keys(t, b, c, spec)
	c.Close()
	if c.StorageReads() != 1 || c.DiskHits() != 5 {
		t.Fatalf("one shard rewritten: %d storage reads, %d disk hits; want 1 and 5", c.StorageReads(), c.DiskHits())
	}
}

// The tier holds no more than its budget; what it keeps is what the open
// sessions read soonest.
func TestDiskTierBudget(t *testing.T) {
	b := dataset(t, 8, 10, 2000)
	dir := t.TempDir()
	size := shardSize(t, b) + diskTrailer
	c := withDisk(t, dir, 3*size)
	keys(t, b, c, Spec{BatchSize: 7, WorldSize: 1, Seed: 1})
	c.Close()
	files, _ := diskFiles(t, dir)
	var total int64
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		total += fi.Size()
	}
	if len(files) == 0 || total > 3*size {
		t.Fatalf("%d files of %d bytes in a tier of %d", len(files), total, 3*size)
	}
	if _, err := newDiskCache(dir, size, slog.Default()); err != nil { // a smaller budget at the next start
		t.Fatal(err)
	}
	if files, _ = diskFiles(t, dir); len(files) > 1 {
		t.Fatalf("%d files kept in a tier of one shard", len(files))
	}
}

// getCounter counts a backend's reads of objects.
type getCounter struct {
	storage.Backend
	gets atomic.Int64
}

func (g *getCounter) Get(ctx context.Context, name string, off, n int64) (io.ReadCloser, error) {
	g.gets.Add(1)
	return g.Backend.Get(ctx, name, off, n)
}

// From a real S3 (MinIO), a daemon restarted on its disk tier lists the
// dataset but reads no shard from the store.
func TestDiskTierWithS3(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b, err := s3.New(t.Context(), s3.Config{
		Bucket: bucket, Endpoint: srv.Endpoint(), Region: miniotest.Region, Credentials: srv.Credentials(),
		Retry: s3.RetryPolicy{Deadline: 30 * time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	for s := range 4 {
		name := fmt.Sprintf("shard-%03d", s)
		data := makeTar(t, name, 10, 3000)
		if err := b.Put(t.Context(), "train/"+name+".tar", bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatal(err)
		}
	}
	counted := &getCounter{Backend: b}
	dir := t.TempDir()
	spec := Spec{BatchSize: 6, WorldSize: 1, Seed: 3}
	c := withDisk(t, dir, 64<<20)
	want, _ := keys(t, counted, c, spec)
	c.Close()
	if counted.gets.Load() != 4 {
		t.Fatalf("first epoch: %d reads from S3, want 4", counted.gets.Load())
	}
	counted.gets.Store(0)
	c = withDisk(t, dir, 64<<20)
	got, _ := keys(t, counted, c, spec)
	c.Close()
	if !slices.Equal(got, want) || counted.gets.Load() != 0 || c.DiskHits() != 4 {
		t.Fatalf("after a restart: %d reads from S3, %d disk hits; want every shard from disk", counted.gets.Load(), c.DiskHits())
	}
}

// A daemon's service with --disk-cache-dir: a restarted one serves a
// remote source's shards from the disk, and its metrics say so.
func TestDiskTierMetrics(t *testing.T) {
	b := posixDataset(t, 3, 10, 2000) // not a local source: "remote"
	dir := t.TempDir()
	epoch := func() *Metrics {
		m := NewMetrics(nil)
		s := newService(t, b, ServiceConfig{DiskCacheDir: dir, DiskCacheBytes: 64 << 20, Metrics: m})
		owner, _ := connection("trainer")
		id, _, err := s.OpenSession(context.Background(), owner, src, Spec{BatchSize: 8, WorldSize: 1})
		if err != nil {
			t.Fatal(err)
		}
		var release []string
		for {
			_, lease, _, err := s.Next(context.Background(), owner, id, release)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			release = []string{lease}
		}
		if err := s.CloseSession(owner, id); err != nil && !errors.Is(err, ErrUnknownSession) {
			t.Fatal(err)
		}
		s.cache.Close() // waits for the tier's writes (the service's Close, at the test's end, closes it again)
		return m
	}
	first := epoch()
	if hits := testutil.ToFloat64(first.DiskHits); hits != 0 || testutil.ToFloat64(first.DiskBytes) == 0 {
		t.Fatalf("first run: %v disk hits, %v bytes on disk", hits, testutil.ToFloat64(first.DiskBytes))
	}
	if hits := testutil.ToFloat64(epoch().DiskHits); hits != 3 {
		t.Fatalf("restarted: %v disk hits, want the 3 shards", hits)
	}
	a, err := arena.Open(arena.Options{Dir: t.TempDir(), Size: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := NewService(shmArena{a}, ServiceConfig{DiskCacheBytes: 1 << 20, Allow: []string{"s3://x"}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("--disk-cache-bytes without a dir: %v", err)
	}
}

// Shards too large to be read whole are streamed; the disk tier keeps
// them as they pass, and a restarted daemon streams them from the disk
// (a file damaged there is dropped and read from the store again).
func TestDiskTierStreamedShards(t *testing.T) {
	counted := &getCounter{Backend: dataset(t, 3, 40, 8000)} // ~330 KiB shards
	dir := t.TempDir()
	spec := Spec{BatchSize: 16, WorldSize: 1, Seed: 5}
	opts := Options{ReadAheadBytes: 1 << 20} // streams shards over 128 KiB
	c := withDisk(t, dir, 64<<20)
	want, _ := keysOpts(t, counted, c, spec, opts)
	c.Close()
	files, _ := diskFiles(t, dir)
	if len(files) != 3 || counted.gets.Load() < 3 {
		t.Fatalf("first epoch: %d files on disk, %d reads from the store", len(files), counted.gets.Load())
	}
	counted.gets.Store(0)
	c = withDisk(t, dir, 64<<20)
	got, _ := keysOpts(t, counted, c, spec, opts)
	c.Close()
	if !slices.Equal(got, want) || counted.gets.Load() != 0 || c.DiskHits() != 3 {
		t.Fatalf("restarted: %d reads from the store, %d disk hits; want all 3 streamed from disk", counted.gets.Load(), c.DiskHits())
	}
	data, err := os.ReadFile(files[2])
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 1
	writeFile(t, files[2], data)
	c = withDisk(t, dir, 64<<20)
	got, _ = keysOpts(t, counted, c, spec, opts)
	c.Close()
	if !slices.Equal(got, want) || c.DiskHits() != 2 || counted.gets.Load() == 0 {
		t.Fatalf("a damaged file: %d disk hits, %d reads from the store; want 2 and the third from the store", c.DiskHits(), counted.gets.Load())
	}
}

// A disk that fails a write (full, broken) fails the tier's copy only:
// the shard teed into it reads on, and commit gives the copy up.
func TestDiskWriteErrorIsTheTiers(t *testing.T) {
	d, err := newDiskCache(t.TempDir(), 1<<20, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	name, f := d.reserve("k", 8, nil, 0)
	if f == nil {
		t.Fatal("no room reserved")
	}
	w, err := d.create(name, f)
	if err != nil {
		t.Fatal(err)
	}
	w.tmp.Close() // every write fails from now on
	if n, err := w.Write([]byte("shard!!!")); n != 8 || err != nil {
		t.Fatalf("a failed disk write = %d, %v; want 8, nil", n, err)
	}
	if err := w.commit(); err == nil {
		t.Fatal("commit after a failed write succeeded")
	}
	w.abort(err)
}

// Shards stored, loaded and evicted at once from many goroutines leave
// the books and the folder agreeing: every file kept is in the books at
// its size, none in the books is missing, and the budget holds. An
// eviction freed a name before its file, once, so a shard reserved again
// meanwhile lost its file or its entry.
func TestDiskBooksMatchTheFolder(t *testing.T) {
	dir := t.TempDir()
	const shard, keys = 4 << 10, 6
	d, err := newDiskCache(dir, 2*(shard+diskTrailer), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			data := bytes.Repeat([]byte{byte(g)}, shard)
			for i := range 300 {
				key := fmt.Sprint("k", (g*7+i)%keys)
				if _, ok := d.load(key, shard); ok {
					continue
				}
				if write := d.store(key, data, nil, 0); write != nil {
					write()
				}
			}
		})
	}
	wg.Wait()
	shards, temps := diskFiles(t, dir)
	if len(temps) != 0 {
		t.Errorf("temporaries left: %v", temps)
	}
	var onDisk int64
	for _, p := range shards {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		f := d.files[filepath.Base(p)]
		if f == nil || f.size != fi.Size() || f.writing {
			t.Errorf("file %s (%d bytes) is not in the books as kept: %+v", filepath.Base(p), fi.Size(), f)
		}
		onDisk += fi.Size()
	}
	if len(shards) != len(d.files) || onDisk != d.used || d.used > d.budget {
		t.Errorf("%d files of %d bytes on disk; books: %d files, %d bytes, budget %d", len(shards), onDisk, len(d.files), d.used, d.budget)
	}
}
