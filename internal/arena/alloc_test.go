package arena

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
)

const (
	kib = int64(1) << 10
	mib = int64(1) << 20
)

func mustAlloc(t testing.TB, a *allocator, n int64) Region {
	t.Helper()
	r, err := a.alloc(context.Background(), n)
	if err != nil {
		t.Fatalf("alloc(%d): %v", n, err)
	}
	return r
}

func mustFree(t testing.TB, a *allocator, r Region) {
	t.Helper()
	if err := a.freeRegion(r); err != nil {
		t.Fatalf("free(%v): %v", r, err)
	}
}

func TestAllocAlignment(t *testing.T) {
	tests := []struct {
		n     int64
		align int64
		taken int64
	}{
		{1, 4 * kib, 4 * kib},
		{4*kib - 1, 4 * kib, 4 * kib},
		{4 * kib, 4 * kib, 4 * kib},
		{4*kib + 1, 4 * kib, 8 * kib},
		{2*mib - 1, 4 * kib, 2 * mib},
		{2 * mib, 2 * mib, 2 * mib},
		{2*mib + 1, 2 * mib, 2*mib + 4*kib},
		{3 * mib, 2 * mib, 3 * mib},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.n), func(t *testing.T) {
			a := newAllocator(16 * mib)
			mustAlloc(t, a, 100) // so that offset 0, aligned to anything, is taken
			r := mustAlloc(t, a, tt.n)
			if r.Offset%tt.align != 0 {
				t.Errorf("offset %d not aligned to %d", r.Offset, tt.align)
			}
			if r.Length != tt.n {
				t.Errorf("length %d, want %d", r.Length, tt.n)
			}
			if got := a.usedBytes() - 4*kib; got != tt.taken {
				t.Errorf("took %d bytes, want %d", got, tt.taken)
			}
			checkInvariants(t, a)
		})
	}
}

func TestFirstFitAndCoalescing(t *testing.T) {
	a := newAllocator(64 * kib)
	ra := mustAlloc(t, a, 4*kib)
	rb := mustAlloc(t, a, 8*kib)
	rc := mustAlloc(t, a, 4*kib)
	if ra.Offset != 0 || rb.Offset != 4*kib || rc.Offset != 12*kib {
		t.Fatalf("offsets %v %v %v, want 0, 4K, 12K", ra, rb, rc)
	}

	mustFree(t, a, rb)
	if r := mustAlloc(t, a, 8*kib); r.Offset != rb.Offset {
		t.Fatalf("first fit: got %v, want b's hole at %d", r, rb.Offset)
	} else {
		mustFree(t, a, r)
	}

	mustFree(t, a, ra)
	r := mustAlloc(t, a, 12*kib) // a+b: fits only if a and b coalesced
	if r.Offset != 0 {
		t.Fatalf("a+b sized alloc at %v, want offset 0", r)
	}
	mustFree(t, a, r)
	mustFree(t, a, rc)
	if len(a.free) != 1 || a.free[0] != (span{0, 64 * kib}) {
		t.Fatalf("free list after freeing everything: %v", a.free)
	}
}

func TestAllocRejects(t *testing.T) {
	tests := []struct {
		n       int64
		want    error
		message []string
	}{
		{0, ErrInvalidRegion, nil},
		{-1, ErrInvalidRegion, nil},
		{8*mib + 1, ErrTooLarge, []string{"8388609", "8388608"}},
		{1 << 62, ErrTooLarge, nil},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.n), func(t *testing.T) {
			a := newAllocator(8 * mib)
			_, err := a.alloc(context.Background(), tt.n)
			if !errors.Is(err, tt.want) {
				t.Fatalf("alloc(%d) = %v, want %v", tt.n, err, tt.want)
			}
			for _, m := range tt.message {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %s", err, m)
				}
			}
		})
	}
}

// waitQueued waits until n requests are queued, so tests can order events.
func waitQueued(t *testing.T, a *allocator, n int) {
	t.Helper()
	deadline := time.Now().Add(testtime.Scale(30 * time.Second))
	for {
		a.mu.Lock()
		got := len(a.waiters)
		a.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

type result struct {
	r   Region
	err error
}

func allocAsync(a *allocator, ctx context.Context, n int64) <-chan result {
	ch := make(chan result, 1)
	go func() {
		r, err := a.alloc(ctx, n)
		ch <- result{r, err}
	}()
	return ch
}

func recv(t *testing.T, ch <-chan result) result {
	t.Helper()
	select {
	case res := <-ch:
		return res
	case <-time.After(testtime.Scale(30 * time.Second)):
		t.Fatal("alloc did not return")
		return result{}
	}
}

func TestAllocWaitsForFree(t *testing.T) {
	a := newAllocator(1 * mib)
	full := mustAlloc(t, a, 1*mib)
	ch := allocAsync(a, context.Background(), 512*kib)
	waitQueued(t, a, 1)
	select {
	case res := <-ch:
		t.Fatalf("alloc returned %v, %v while the arena was full", res.r, res.err)
	default:
	}
	mustFree(t, a, full)
	res := recv(t, ch)
	if res.err != nil || res.r.Length != 512*kib {
		t.Fatalf("woken alloc = %v, %v", res.r, res.err)
	}
	checkInvariants(t, a)
}

func TestAllocTimesOutWithErrFull(t *testing.T) {
	a := newAllocator(4 * mib)
	mustAlloc(t, a, 3*mib)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := a.alloc(ctx, 2*mib)
	if !errors.Is(err, ErrFull) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want ErrFull and DeadlineExceeded", err)
	}
	for _, want := range []string{"2097152 bytes", "4194304-byte staging budget", "3145728 bytes in use"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if n := len(a.waiters); n != 0 {
		t.Errorf("%d waiters left behind", n)
	}
}

func TestAllocCanceledBeforeStart(t *testing.T) {
	a := newAllocator(4 * mib)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := a.alloc(ctx, 4*kib); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if a.usedBytes() != 0 {
		t.Fatal("a canceled alloc took space")
	}
}

// A large request must not be overtaken by smaller ones that arrive later,
// or a stream of small saves could starve it.
func TestAllocIsFIFO(t *testing.T) {
	a := newAllocator(4 * mib)
	r1 := mustAlloc(t, a, 2*mib)
	mustAlloc(t, a, 1*mib)
	big := allocAsync(a, context.Background(), 2*mib)
	waitQueued(t, a, 1)
	small := allocAsync(a, context.Background(), 4*kib) // would fit right now
	waitQueued(t, a, 2)

	mustFree(t, a, r1)
	if res := recv(t, big); res.err != nil || res.r.Offset != 0 {
		t.Fatalf("big = %v, %v", res.r, res.err)
	}
	if res := recv(t, small); res.err != nil {
		t.Fatalf("small = %v", res.err)
	}
	checkInvariants(t, a)
}

// When the head of the queue gives up, those behind it that fit must not
// be left waiting for a Free that may never come.
func TestCanceledHeadUnblocksQueue(t *testing.T) {
	a := newAllocator(4 * mib)
	mustAlloc(t, a, 3*mib)
	ctx, cancel := context.WithCancel(context.Background())
	big := allocAsync(a, ctx, 2*mib)
	waitQueued(t, a, 1)
	small := allocAsync(a, context.Background(), 4*kib)
	waitQueued(t, a, 2)

	cancel()
	if res := recv(t, big); !errors.Is(res.err, ErrFull) {
		t.Fatalf("big = %v, want ErrFull", res.err)
	}
	if res := recv(t, small); res.err != nil {
		t.Fatalf("small = %v", res.err)
	}
}

func TestCloseFailsWaiters(t *testing.T) {
	a := newAllocator(1 * mib)
	mustAlloc(t, a, 1*mib)
	ch := allocAsync(a, context.Background(), 4*kib)
	waitQueued(t, a, 1)
	a.close()
	if res := recv(t, ch); !errors.Is(res.err, ErrClosed) {
		t.Fatalf("err = %v, want ErrClosed", res.err)
	}
	if _, err := a.alloc(context.Background(), 4*kib); !errors.Is(err, ErrClosed) {
		t.Fatalf("alloc after close = %v, want ErrClosed", err)
	}
}

func TestFreeRejects(t *testing.T) {
	a := newAllocator(1 * mib)
	r := mustAlloc(t, a, 10*kib)
	other := mustAlloc(t, a, 4*kib)
	mustFree(t, a, r)
	tests := []struct {
		name string
		r    Region
	}{
		{"double free", r},
		{"wrong length", Region{other.Offset, other.Length + 1}},
		{"inside a region", Region{other.Offset + 1, 1}},
		{"never allocated", Region{512 * kib, 4 * kib}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			used, free := a.usedBytes(), fmt.Sprint(a.free)
			if err := a.freeRegion(tt.r); !errors.Is(err, ErrNotAllocated) {
				t.Fatalf("free(%v) = %v, want ErrNotAllocated", tt.r, err)
			}
			if a.usedBytes() != used || fmt.Sprint(a.free) != free {
				t.Fatal("a rejected free changed the allocator")
			}
			checkInvariants(t, a)
		})
	}
}

func TestReserve(t *testing.T) {
	tests := []struct {
		name string
		r    Region
		want error
	}{
		{"free space", Region{512 * kib, 100 * kib}, nil},
		{"end of arena", Region{1*mib - 4*kib, 4 * kib}, nil},
		{"overlaps start", Region{0, 4 * kib}, ErrOverlap},
		{"overlaps tail", Region{4 * kib, 1}, ErrOverlap},
		{"straddles", Region{252 * kib, 8 * kib}, ErrOverlap},
		{"unaligned", Region{300*kib + 1, 4 * kib}, ErrInvalidRegion},
		{"empty", Region{300 * kib, 0}, ErrInvalidRegion},
		{"negative", Region{-4 * kib, 4 * kib}, ErrInvalidRegion},
		{"past end", Region{1*mib - 4*kib, 4*kib + 1}, ErrInvalidRegion},
		{"beyond", Region{2 * mib, 4 * kib}, ErrInvalidRegion},
		{"overflow", Region{4 * kib, 1<<63 - 1}, ErrInvalidRegion},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := newAllocator(1 * mib)
			mustAlloc(t, a, 5*kib)                                        // [0, 8K)
			if err := a.reserve(Region{256 * kib, 4 * kib}); err != nil { // [256K, 260K)
				t.Fatal(err)
			}
			err := a.reserve(tt.r)
			if !errors.Is(err, tt.want) {
				t.Fatalf("reserve(%v) = %v, want %v", tt.r, err, tt.want)
			}
			checkInvariants(t, a)
			if err != nil {
				return
			}
			if err := a.reserve(tt.r); !errors.Is(err, ErrOverlap) {
				t.Fatalf("second reserve = %v, want ErrOverlap", err)
			}
			mustFree(t, a, tt.r)
		})
	}
}

func TestReservedRegionsAreAvoided(t *testing.T) {
	a := newAllocator(16 * kib)
	if err := a.reserve(Region{4 * kib, 4 * kib}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []int64{0, 8 * kib, 12 * kib} {
		if r := mustAlloc(t, a, 4*kib); r.Offset != want {
			t.Fatalf("alloc at %d, want %d", r.Offset, want)
		}
	}
}

// checkInvariants: free spans sorted, coalesced, inside the arena;
// allocations aligned and disjoint from each other and from free spans;
// used + free == size.
func checkInvariants(t testing.TB, a *allocator) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	var freeBytes int64
	type iv struct {
		off, end int64
		what     string
	}
	var all []iv
	for i, s := range a.free {
		if s.off >= s.end || s.off < 0 || s.end > a.size {
			t.Fatalf("bad free span %v", s)
		}
		if i > 0 && a.free[i-1].end >= s.off {
			t.Fatalf("free spans %v and %v not sorted and coalesced", a.free[i-1], s)
		}
		freeBytes += s.end - s.off
		all = append(all, iv{s.off, s.end, "free"})
	}
	var used int64
	for off, al := range a.allocs {
		if off%alignmentFor(al.length) != 0 {
			t.Fatalf("allocation at %d of %d bytes misaligned", off, al.length)
		}
		if al.end != alignUp(off+al.length, pageSize) || al.end > a.size {
			t.Fatalf("allocation at %d: end %d for length %d", off, al.end, al.length)
		}
		used += al.end - off
		all = append(all, iv{off, al.end, "alloc"})
	}
	if used != a.used {
		t.Fatalf("used %d, allocations sum to %d", a.used, used)
	}
	if used+freeBytes != a.size {
		t.Fatalf("used %d + free %d != size %d", used, freeBytes, a.size)
	}
	// Disjoint: sort by offset and compare neighbours.
	for i := 1; i < len(all); i++ {
		for j := i; j > 0 && all[j].off < all[j-1].off; j-- {
			all[j], all[j-1] = all[j-1], all[j]
		}
	}
	for i := 1; i < len(all); i++ {
		if all[i-1].end > all[i].off {
			t.Fatalf("%s [%d,%d) overlaps %s [%d,%d)", all[i-1].what, all[i-1].off, all[i-1].end,
				all[i].what, all[i].off, all[i].end)
		}
	}
}

func TestRandomAllocFree(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, seed))
			a := newAllocator(64 * mib)
			var live []Region
			var allocs, misses int
			for range 2000 {
				if len(live) > 0 && rng.IntN(100) < 45 {
					i := rng.IntN(len(live))
					mustFree(t, a, live[i])
					live = append(live[:i], live[i+1:]...)
				} else {
					if r, ok := tryAlloc(a, randomSize(rng)); ok {
						live = append(live, r)
						allocs++
					} else {
						misses++
					}
				}
				checkInvariants(t, a)
			}
			if allocs < 500 || misses == 0 {
				t.Fatalf("%d allocations, %d misses: the test does not exercise a full arena", allocs, misses)
			}
			for _, r := range live {
				mustFree(t, a, r)
			}
			if len(a.free) != 1 || a.used != 0 {
				t.Fatalf("after freeing everything: free %v, used %d", a.free, a.used)
			}
		})
	}
}

// tryAlloc allocates without waiting.
func tryAlloc(a *allocator, n int64) (Region, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.take(n)
}

func randomSize(rng *rand.Rand) int64 {
	switch rng.IntN(4) {
	case 0:
		return 1 + rng.Int64N(8*kib)
	case 1:
		return 1 + rng.Int64N(2*mib)
	case 2:
		return 2*mib + rng.Int64N(6*mib)
	default:
		return 1 + rng.Int64N(256*kib)
	}
}

func TestConcurrentAllocFree(t *testing.T) {
	a := newAllocator(32 * mib)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for range 300 {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Millisecond)
				r, err := a.alloc(ctx, randomSize(rng))
				cancel()
				if errors.Is(err, context.DeadlineExceeded) { // ErrFull, or expired before it could wait
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				if err := a.freeRegion(r); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	checkInvariants(t, a)
	if a.usedBytes() != 0 || len(a.waiters) != 0 {
		t.Fatalf("used %d, %d waiters after all goroutines finished", a.usedBytes(), len(a.waiters))
	}
}

func BenchmarkAllocFree(b *testing.B) {
	a := newAllocator(1 << 30)
	// Some live regions so the free list is not trivially one span.
	for i := range 64 {
		r := mustAlloc(b, a, int64(i+1)*64*kib)
		if i%2 == 0 {
			mustFree(b, a, r)
		}
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		r, err := a.alloc(ctx, 1*mib)
		if err != nil {
			b.Fatal(err)
		}
		if err := a.freeRegion(r); err != nil {
			b.Fatal(err)
		}
	}
}
