package counted_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"maps"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/counted"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/posix"
	"github.com/ckptd/ckptd/storage/storagetest"
)

// tally records the failures a counted backend reports.
type tally struct {
	mu sync.Mutex
	m  map[string]int
}

func (t *tally) failed(op string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]int{}
	}
	t.m[op]++
}

func (t *tally) counts() map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.m)
}

// store is a counted directory store with faults to inject beneath the
// counting.
func store(t *testing.T) (*counted.Backend, *faulty.Backend, *tally) {
	t.Helper()
	b, err := posix.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	f := faulty.New(b)
	var n tally
	return counted.New(f, n.failed), f, &n
}

// The wrapper changes nothing about what the backend does.
func TestConformance(t *testing.T) {
	storagetest.Run(t, func(t *testing.T) storage.Backend {
		c, _, _ := store(t)
		return c
	})
}

func put(ctx context.Context, b storage.Backend, name, data string) error {
	return b.Put(ctx, name, bytes.NewReader([]byte(data)), int64(len(data)))
}

// Every operation that fails counts once, by name.
func TestFailuresCounted(t *testing.T) {
	c, f, n := store(t)
	ctx := t.Context()
	if err := put(ctx, c, "a/obj", "data"); err != nil {
		t.Fatal(err)
	}
	outage := f.Outage(faulty.OpAll)
	_ = put(ctx, c, "a/new", "x")
	_ = c.PutIfAbsent(ctx, "a/commit", []byte("c"))
	_, _ = c.Get(ctx, "a/obj", 0, -1)
	_, _ = c.Stat(ctx, "a/obj")
	_ = c.List(ctx, "a/", func(storage.ObjectInfo) error { return nil })
	_ = c.ListDirs(ctx, "", func(string) error { return nil })
	_ = c.Delete(ctx, "a/obj")
	_ = c.ListTemporaries(ctx, "a/", func(storage.Temporary) error { return nil })
	_ = c.DeleteTemporary(ctx, storage.Temporary{Name: "a/obj", ID: ".obj.tmp-0123456789abcdef"})
	outage.Remove()
	want := map[string]int{counted.OpPut: 1, counted.OpPutIfAbsent: 1, counted.OpGet: 1, counted.OpStat: 1,
		counted.OpList: 1, counted.OpListDirs: 1, counted.OpDelete: 1, counted.OpListTemps: 1, counted.OpDeleteTemp: 1}
	if got := n.counts(); !maps.Equal(got, want) {
		t.Fatalf("counted %v, want %v", got, want)
	}
}

// Answers, refused names, a caller that gave up and a listing its
// callback stopped are not failures of the store.
func TestAnswersNotCounted(t *testing.T) {
	c, _, n := store(t)
	ctx := t.Context()
	if err := c.PutIfAbsent(ctx, "a/commit", []byte("c")); err != nil {
		t.Fatal(err)
	}
	if err := c.PutIfAbsent(ctx, "a/commit", []byte("c")); !errors.Is(err, storage.ErrExists) {
		t.Fatalf("second PutIfAbsent: %v", err)
	}
	if _, err := c.Stat(ctx, "a/missing"); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("Stat of a missing object: %v", err)
	}
	if _, err := c.Get(ctx, "a/missing", 0, -1); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("Get of a missing object: %v", err)
	}
	if _, err := c.Stat(ctx, "../escape"); !errors.Is(err, storage.ErrInvalidName) {
		t.Fatalf("Stat of an invalid name: %v", err)
	}
	stop := errors.New("enough")
	if err := c.List(ctx, "a/", func(storage.ObjectInfo) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("List stopped by its callback: %v", err)
	}
	if err := c.ListDirs(ctx, "", func(string) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("ListDirs stopped by its callback: %v", err)
	}
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if err := put(canceled, c, "a/late", "x"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Put with a canceled context: %v", err)
	}
	if got := n.counts(); len(got) != 0 {
		t.Fatalf("counted %v for answers", got)
	}
}

// A Get whose body breaks off while it is read is a failed get, counted
// once however often the reader is retried; one read to its end is not.
func TestBrokenBodyCounted(t *testing.T) {
	c, f, n := store(t)
	ctx := t.Context()
	if err := put(ctx, c, "a/obj", "0123456789"); err != nil {
		t.Fatal(err)
	}
	rc, err := c.Get(ctx, "a/obj", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(rc); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	f.Inject(faulty.Fault{Kind: faulty.ShortRead, Ops: faulty.OpGet, N: 4, Err: storage.ErrUnavailable})
	rc, err = c.Get(ctx, "a/obj", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	for range 3 {
		if _, err := io.ReadAll(rc); !errors.Is(err, storage.ErrUnavailable) {
			t.Fatalf("reading a broken body: %v", err)
		}
	}
	if got := n.counts(); !maps.Equal(got, map[string]int{counted.OpGet: 1}) {
		t.Fatalf("counted %v, want one get", got)
	}
}

// The bytes Gets' bodies return are counted, as they are read.
func TestReadBytesCounted(t *testing.T) {
	c, _, _ := store(t)
	var seen atomic.Int64
	c.OnRead(func(n int64) { seen.Add(n) })
	ctx := t.Context()
	if err := put(ctx, c, "a/obj", "0123456789"); err != nil {
		t.Fatal(err)
	}
	for _, r := range [][2]int64{{0, -1}, {2, 3}} {
		rc, err := c.Get(ctx, "a/obj", r[0], r[1])
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadAll(rc); err != nil {
			t.Fatal(err)
		}
		rc.Close()
	}
	if c.ReadBytes() != 13 || seen.Load() != 13 {
		t.Fatalf("read %d bytes, reported %d; want 13", c.ReadBytes(), seen.Load())
	}
}

// Every call counts, failed, answered or stopped by its callback; a
// listing counts once, whatever it lists.
func TestCallsCounted(t *testing.T) {
	c, f, _ := store(t)
	ctx := t.Context()
	for _, name := range []string{"a/1", "a/2", "a/3"} {
		if err := put(ctx, c, name, "x"); err != nil {
			t.Fatal(err)
		}
	}
	_ = c.PutIfAbsent(ctx, "a/1", []byte("c")) // exists
	_, _ = c.Stat(ctx, "a/missing")
	rc, err := c.Get(ctx, "a/1", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	rc.Close()
	_ = c.List(ctx, "a/", func(storage.ObjectInfo) error { return nil })
	_ = c.List(ctx, "a/", func(storage.ObjectInfo) error { return errors.New("stop") })
	outage := f.Outage(faulty.OpAll)
	_ = c.Delete(ctx, "a/1")
	outage.Remove()
	want := map[string]int64{counted.OpPut: 3, counted.OpPutIfAbsent: 1, counted.OpStat: 1, counted.OpGet: 1,
		counted.OpList: 2, counted.OpDelete: 1}
	if got := c.Calls(); !maps.Equal(got, want) {
		t.Fatalf("calls %v, want %v", got, want)
	}
}
