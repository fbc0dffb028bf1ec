package arena

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
)

const (
	pageSize = 4 << 10
	// Regions of at least hugePageSize start on a 2 MiB boundary so that
	// they can be backed by huge pages and registered for DMA in whole
	// huge pages.
	hugePageSize = 2 << 20
)

// Region is a byte range of the arena: file offset and length as requested.
// The allocator reserves Length rounded up to a whole page.
type Region struct {
	Offset, Length int64
}

func (r Region) String() string {
	return fmt.Sprintf("[%d,+%d)", r.Offset, r.Length)
}

// span is a free range [off, end).
type span struct{ off, end int64 }

type allocation struct {
	length int64 // as requested: Free must present the same Region
	end    int64 // page-rounded end taken from the free list
}

type waiter struct {
	n      int64
	ready  chan struct{} // closed once region or err is set
	region Region
	err    error
}

// allocator is the arena's bookkeeping, kept apart from the mapping so it
// can be tested and benchmarked without shared memory.
type allocator struct {
	size int64 // a multiple of pageSize
	// pages aligns every region to a page only: for memory no one
	// registers for DMA nor backs with huge pages (the hot tier's pool),
	// where 2 MiB alignment would only waste room.
	pages bool

	mu      sync.Mutex
	free    []span // sorted by off; neighbours never touch (always coalesced)
	allocs  map[int64]allocation
	used    int64
	waiters []*waiter // FIFO
	closed  bool
}

func newAllocator(size int64) *allocator {
	return &allocator{
		size:   size,
		free:   []span{{0, size}},
		allocs: make(map[int64]allocation),
	}
}

func alignUp(x, a int64) int64 { return (x + a - 1) &^ (a - 1) }

// alignmentFor is where a region of n bytes may start.
func (a *allocator) alignmentFor(n int64) int64 {
	if a.pages {
		return pageSize
	}
	return alignmentFor(n)
}

func alignmentFor(n int64) int64 {
	if n >= hugePageSize {
		return hugePageSize
	}
	return pageSize
}

// alloc hands out n bytes, waiting for Free while ctx allows.
//
// Waiters are served strictly in arrival order and a new request queues
// behind existing waiters even when it would fit: otherwise a stream of
// small saves could starve a large one forever. Every region is freed once
// drained, so the head of the queue always fits eventually.
func (a *allocator) alloc(ctx context.Context, n int64) (Region, error) {
	if n <= 0 {
		return Region{}, fmt.Errorf("%w: alloc of %d bytes", ErrInvalidRegion, n)
	}
	if n > a.size {
		return Region{}, fmt.Errorf("%w: %d bytes requested, the arena is %d bytes", ErrTooLarge, n, a.size)
	}
	if err := ctx.Err(); err != nil {
		return Region{}, fmt.Errorf("arena: alloc of %d bytes: %w", n, err)
	}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return Region{}, ErrClosed
	}
	if len(a.waiters) == 0 {
		if r, ok := a.take(n); ok {
			a.mu.Unlock()
			return r, nil
		}
	}
	w := &waiter{n: n, ready: make(chan struct{})}
	a.waiters = append(a.waiters, w)
	a.mu.Unlock()
	return a.wait(ctx, w)
}

func (a *allocator) wait(ctx context.Context, w *waiter) (Region, error) {
	select {
	case <-w.ready:
		return w.region, w.err
	case <-ctx.Done():
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	select {
	case <-w.ready:
		if w.err != nil {
			return Region{}, w.err
		}
		// Granted while giving up: put it back so that an error always
		// means there is nothing to free.
		a.release(w.region)
		a.grant()
	default:
		a.dropWaiter(w)
	}
	return Region{}, a.fullError(w.n, ctx.Err())
}

func (a *allocator) fullError(n int64, cause error) error {
	largest := int64(0)
	for _, s := range a.free {
		largest = max(largest, s.end-s.off)
	}
	return fmt.Errorf("%w: no room for %d bytes in the %d-byte staging budget "+
		"(%d bytes in use, largest free span %d bytes, %d requests waiting): %w",
		ErrFull, n, a.size, a.used, largest, len(a.waiters), cause)
}

func (a *allocator) dropWaiter(w *waiter) {
	i := slices.Index(a.waiters, w)
	if i < 0 {
		return
	}
	a.waiters = slices.Delete(a.waiters, i, i+1)
	if i == 0 {
		// The head may have been what held the others back.
		a.grant()
	}
}

// grant serves waiters in order for as long as the head fits.
func (a *allocator) grant() {
	for len(a.waiters) > 0 {
		w := a.waiters[0]
		r, ok := a.take(w.n)
		if !ok {
			return
		}
		w.region = r
		close(w.ready)
		a.waiters = slices.Delete(a.waiters, 0, 1)
	}
}

// take is first fit: the lowest-addressed free span that holds the aligned
// request. Low addresses stay busy and the top of the arena stays in large
// pieces for big requests.
func (a *allocator) take(n int64) (Region, bool) {
	i, start, end := a.firstFit(n)
	if i < 0 {
		return Region{}, false
	}
	a.carve(i, start, end)
	a.allocs[start] = allocation{length: n, end: end}
	a.used += end - start
	return Region{Offset: start, Length: n}, true
}

// firstFit returns the free span take would carve n bytes out of, and
// where; i is -1 when none holds them.
func (a *allocator) firstFit(n int64) (i int, start, end int64) {
	align := a.alignmentFor(n)
	length := alignUp(n, pageSize)
	for i, s := range a.free {
		start := alignUp(s.off, align)
		if end := start + length; end <= s.end {
			return i, start, end
		}
	}
	return -1, 0, 0
}

// tryTake is take without waiting, for a caller that has no queue of its
// own: a region, or none.
func (a *allocator) tryTake(n int64) (Region, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.take(n)
}

// fits reports whether take would find n bytes now.
func (a *allocator) fits(n int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	i, _, _ := a.firstFit(n)
	return i >= 0
}

// carve removes [start, end) from free span i, keeping what is left on
// either side.
func (a *allocator) carve(i int, start, end int64) {
	s := a.free[i]
	var rest []span
	if s.off < start {
		rest = append(rest, span{s.off, start})
	}
	if end < s.end {
		rest = append(rest, span{end, s.end})
	}
	a.free = slices.Replace(a.free, i, i+1, rest...)
}

func (a *allocator) freeRegion(r Region) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	if err := a.release(r); err != nil {
		return err
	}
	a.grant()
	return nil
}

func (a *allocator) release(r Region) error {
	al, ok := a.allocs[r.Offset]
	if !ok {
		return fmt.Errorf("%w: free of %v (double free?)", ErrNotAllocated, r)
	}
	if al.length != r.Length {
		return fmt.Errorf("%w: free of %v, but the region at offset %d has length %d",
			ErrNotAllocated, r, r.Offset, al.length)
	}
	delete(a.allocs, r.Offset)
	a.used -= al.end - r.Offset
	a.insertFree(span{r.Offset, al.end})
	return nil
}

func (a *allocator) insertFree(s span) {
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > s.off })
	if i < len(a.free) && a.free[i].off == s.end {
		s.end = a.free[i].end
		a.free = slices.Delete(a.free, i, i+1)
	}
	if i > 0 && a.free[i-1].end == s.off {
		a.free[i-1].end = s.end
		return
	}
	a.free = slices.Insert(a.free, i, s)
}

func (a *allocator) reserve(r Region) error {
	if r.Length <= 0 || r.Offset < 0 || r.Offset%pageSize != 0 {
		return fmt.Errorf("%w: reserve of %v: need a positive length at a %d-byte aligned offset",
			ErrInvalidRegion, r, pageSize)
	}
	if r.Offset >= a.size || r.Length > a.size-r.Offset {
		return fmt.Errorf("%w: reserve of %v: outside the %d-byte arena", ErrInvalidRegion, r, a.size)
	}
	end := alignUp(r.Offset+r.Length, pageSize)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > r.Offset }) - 1
	if i < 0 || a.free[i].end < end {
		return fmt.Errorf("%w: reserve of %v", ErrOverlap, r)
	}
	a.carve(i, r.Offset, end)
	a.allocs[r.Offset] = allocation{length: r.Length, end: end}
	a.used += end - r.Offset
	return nil
}

func (a *allocator) usedBytes() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.used
}

// close fails every waiter; later calls get ErrClosed.
func (a *allocator) close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.closed = true
	for _, w := range a.waiters {
		w.err = ErrClosed
		close(w.ready)
	}
	a.waiters = nil
}
