package faulty_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
	"github.com/ckptd/ckptd/storage/posix"
	"github.com/ckptd/ckptd/storage/storagetest"
)

func TestConformance(t *testing.T) {
	t.Run("memstore", func(t *testing.T) {
		storagetest.Run(t, func(*testing.T) storage.Backend { return faulty.New(memstore.New()) })
	})
	t.Run("posix", func(t *testing.T) {
		storagetest.Run(t, func(t *testing.T) storage.Backend {
			b, err := posix.New(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			return faulty.New(b)
		})
	})
}

func put(t *testing.T, b storage.Backend, name, data string) error {
	t.Helper()
	return b.Put(t.Context(), name, bytes.NewReader([]byte(data)), int64(len(data)))
}

func get(t *testing.T, b storage.Backend, name string) (string, error) {
	t.Helper()
	rc, err := b.Get(t.Context(), name, 0, -1)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	return string(data), err
}

// calls makes one call of every operation and returns their errors.
func calls(t *testing.T, b storage.Backend) map[faulty.Op]error {
	ctx := t.Context()
	_, getErr := get(t, b, "a/obj")
	_, statErr := b.Stat(ctx, "a/obj")
	return map[faulty.Op]error{
		faulty.OpPut:             put(t, b, "a/new", "new"),
		faulty.OpPutIfAbsent:     b.PutIfAbsent(ctx, "a/commit", []byte("c")),
		faulty.OpGet:             getErr,
		faulty.OpStat:            statErr,
		faulty.OpList:            b.List(ctx, "a/", func(storage.ObjectInfo) error { return nil }),
		faulty.OpListDirs:        b.ListDirs(ctx, "", func(string) error { return nil }),
		faulty.OpDelete:          b.Delete(ctx, "a/gone"),
		faulty.OpListTemporaries: b.ListTemporaries(ctx, "a/", func(storage.Temporary) error { return nil }),
	}
}

// TestOutage turns an outage of some operations on and off while the
// store is in use.
func TestOutage(t *testing.T) {
	for _, ops := range []faulty.Op{faulty.OpAll, faulty.OpReads, faulty.OpWrites, faulty.OpGet | faulty.OpPutIfAbsent} {
		t.Run(ops.String(), func(t *testing.T) {
			inner := memstore.New()
			b := faulty.New(inner)
			if err := put(t, b, "a/obj", "data"); err != nil {
				t.Fatal(err)
			}
			outage := b.Outage(ops)
			for op, err := range calls(t, b) {
				if down := ops&op != 0; down != errors.Is(err, storage.ErrUnavailable) {
					t.Errorf("%v during an outage of %v: %v", op, ops, err)
				}
			}
			if ops&faulty.OpPut != 0 {
				if _, err := inner.Stat(t.Context(), "a/new"); !errors.Is(err, storage.ErrNotFound) {
					t.Errorf("a Put that failed in the outage stored its object: %v", err)
				}
			}
			outage.Remove()
			inner.Delete(t.Context(), "a/commit")
			for op, err := range calls(t, b) {
				if err != nil {
					t.Errorf("%v after the outage: %v", op, err)
				}
			}
		})
	}
}

func TestFaultByName(t *testing.T) {
	b := faulty.New(memstore.New())
	full := b.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpPut, Name: "job/steps/*/rank-*.data", Err: storage.ErrNoSpace})
	if err := put(t, b, "job/steps/1/rank-0.data", "x"); !errors.Is(err, storage.ErrNoSpace) {
		t.Errorf("Put of a matching name = %v, want ErrNoSpace", err)
	}
	for _, name := range []string{"job/steps/1/rank-0.manifest.json", "job/steps/1/x/rank-0.data", "other"} {
		if err := put(t, b, name, "x"); err != nil {
			t.Errorf("Put %s, not matching: %v", name, err)
		}
	}
	if full.Hits() != 1 {
		t.Errorf("Hits() = %d, want 1", full.Hits())
	}
	b.Clear()
	if err := put(t, b, "job/steps/1/rank-0.data", "x"); err != nil {
		t.Errorf("Put after Clear: %v", err)
	}
}

func TestTimes(t *testing.T) {
	b := faulty.New(memstore.New())
	boom := errors.New("boom")
	r := b.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpStat, Err: boom, Times: 2})
	var errs []error
	for range 4 {
		_, err := b.Stat(t.Context(), "x")
		errs = append(errs, err)
	}
	if !errors.Is(errs[0], boom) || !errors.Is(errs[1], boom) || !errors.Is(errs[2], storage.ErrNotFound) || !errors.Is(errs[3], storage.ErrNotFound) {
		t.Errorf("Stat errors = %v, want boom twice, then the backend's", errs)
	}
	if r.Hits() != 2 {
		t.Errorf("Hits() = %d, want 2", r.Hits())
	}
}

func TestDelay(t *testing.T) {
	b := faulty.New(memstore.New())
	b.Inject(faulty.Fault{Kind: faulty.Delay, Ops: faulty.OpStat, Delay: 50 * time.Millisecond})
	start := time.Now()
	if _, err := b.Stat(t.Context(), "x"); !errors.Is(err, storage.ErrNotFound) {
		t.Errorf("delayed Stat = %v, want the backend's ErrNotFound", err)
	}
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Errorf("Stat took %v, want at least the delay", d)
	}
	b.Inject(faulty.Fault{Kind: faulty.Delay, Delay: time.Hour})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	if _, err := b.Stat(ctx, "x"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Stat delayed past its deadline = %v, want DeadlineExceeded", err)
	}
}

func TestBodyFaults(t *testing.T) {
	const data = "0123456789"
	boom := errors.New("connection reset")
	tests := []struct {
		name  string
		fault faulty.Fault
		want  string
		err   error
	}{
		{"short", faulty.Fault{Kind: faulty.ShortRead, N: 4}, "0123", nil},
		{"short-with-error", faulty.Fault{Kind: faulty.ShortRead, N: 4, Err: boom}, "0123", boom},
		{"short-empty", faulty.Fault{Kind: faulty.ShortRead}, "", nil},
		{"short-past-end", faulty.Fault{Kind: faulty.ShortRead, N: 20}, data, nil},
		{"corrupt", faulty.Fault{Kind: faulty.CorruptRead, N: 3}, "012\xcc456789", nil},
		{"corrupt-past-end", faulty.Fault{Kind: faulty.CorruptRead, N: 10}, data, nil},
		{"other-name", faulty.Fault{Kind: faulty.CorruptRead, Name: "other"}, data, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := faulty.New(memstore.New())
			if err := put(t, b, "obj", data); err != nil {
				t.Fatal(err)
			}
			b.Inject(tt.fault)
			got, err := get(t, b, "obj")
			if got != tt.want || !errors.Is(err, tt.err) || (tt.err == nil) != (err == nil) {
				t.Errorf("Get = %q, %v; want %q, %v", got, err, tt.want, tt.err)
			}
		})
	}
}

func TestFailPutAfter(t *testing.T) {
	for _, inner := range []struct {
		name string
		new  func(t *testing.T) storage.Backend
	}{
		{"memstore", func(*testing.T) storage.Backend { return memstore.New() }},
		{"posix", func(t *testing.T) storage.Backend {
			b, err := posix.New(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { b.Close() })
			return b
		}},
	} {
		t.Run(inner.name, func(t *testing.T) {
			b := faulty.New(inner.new(t))
			if err := put(t, b, "obj", "old"); err != nil {
				t.Fatal(err)
			}
			r := b.Inject(faulty.Fault{Kind: faulty.FailPutAfter, N: 1 << 20})
			big := bytes.Repeat([]byte("x"), 3<<20)
			for _, size := range []int64{int64(len(big)), -1} {
				if err := b.Put(t.Context(), "obj", bytes.NewReader(big), size); !errors.Is(err, storage.ErrUnavailable) {
					t.Errorf("Put failing after 1 MiB (size %d) = %v, want ErrUnavailable", size, err)
				}
			}
			if got, err := get(t, b, "obj"); got != "old" || err != nil {
				t.Errorf("after the failed Puts the object holds %d bytes (%v), want the old", len(got), err)
			}
			if err := put(t, b, "small", "under the limit"); err != nil {
				t.Errorf("Put of fewer bytes than the limit: %v", err)
			}
			r.Remove()
			if err := b.Put(t.Context(), "obj", bytes.NewReader(big), -1); err != nil {
				t.Errorf("Put after Remove: %v", err)
			}
		})
	}
}

// A Put stalled after N bytes is in progress, with its temporary in the
// store, until its context ends; then it fails and stores nothing.
func TestStallPutAfter(t *testing.T) {
	inner, err := posix.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b := faulty.New(inner)
	// The POSIX backend writes in blocks of 4 MiB: the first is in the
	// temporary when the stream stalls in the second.
	const stallAt = 5 << 20
	b.Inject(faulty.Fault{Kind: faulty.StallPutAfter, N: stallAt, Delay: time.Hour})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- b.Put(ctx, "a/obj", bytes.NewReader(bytes.Repeat([]byte("x"), 12<<20)), 12<<20) }()
	var temps []storage.Temporary
	for len(temps) == 0 || temps[0].Size == 0 {
		select {
		case err := <-done:
			t.Fatalf("Put returned %v while it should stall", err)
		case <-time.After(10 * time.Millisecond):
		}
		temps = temps[:0]
		if err := b.ListTemporaries(t.Context(), "a/", func(tmp storage.Temporary) error {
			temps = append(temps, tmp)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if temps[0].Size > stallAt || temps[0].Name != "a/obj" {
		t.Errorf("the stalled Put's temporary = %+v, want at most %d bytes of a/obj", temps[0], stallAt)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("the stalled Put after its context ended = %v, want context.Canceled", err)
	}
	if _, err := b.Stat(t.Context(), "a/obj"); !errors.Is(err, storage.ErrNotFound) {
		t.Errorf("Stat after the stalled Put failed = %v, want ErrNotFound", err)
	}
}

// TestToggleWhileInUse turns an outage on and off while other goroutines
// use the store; run with -race.
func TestToggleWhileInUse(t *testing.T) {
	b := faulty.New(memstore.New())
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for ctx.Err() == nil {
				err := b.Put(ctx, "x", bytes.NewReader([]byte("x")), 1)
				if err != nil && !errors.Is(err, storage.ErrUnavailable) && ctx.Err() == nil {
					t.Errorf("Put: %v", err)
					return
				}
			}
		})
	}
	for ctx.Err() == nil {
		r := b.Outage(faulty.OpAll)
		time.Sleep(time.Millisecond)
		r.Remove()
	}
	wg.Wait()
}

func TestBadPattern(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("Inject with a bad pattern did not panic")
		}
	}()
	faulty.New(memstore.New()).Inject(faulty.Fault{Name: "a["})
}
