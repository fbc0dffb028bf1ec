package prefetch

import (
	"errors"
	"fmt"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// shardMem is the memory of shards read into memory (from S3, or local
// shards that are not mapped): buffers outside the Go heap, taken from
// the kernel once and used again for another shard once nothing aliases
// their bytes. A shard's buffer is wrapped in a mapping, as a mapped
// file is, so whatever keeps its bytes (the cache's entry, a pending
// shard, the samples cut from it) keeps the buffer; when the mapping is
// unreachable, a cleanup hands the buffer back.
//
// Why: new memory costs the kernel a page fault, a zeroed page and its
// books per 4 KiB before a byte lands there. For a shard read from S3
// that was 39% of the daemon's CPU in a first epoch; a buffer used again
// costs none of it, nor the Go heap's zeroing of a reused span. The Go
// heap would give evicted shards' memory back to the kernel (its
// scavenger) and take it again.
//
// Buffers come in size classes of four significant bits (at most 12.5%
// more than asked, which the cache counts in its budget), so that shards
// of about one size share buffers. The pool maps at most limit bytes,
// handed out and free; past that, and below poolAbove, shards are read
// into the Go heap. Those the cache keeps count with its buffers
// (cached): when they need room, free buffers are unmapped. A buffer
// comes back at the first garbage collection after its shard left the
// cache and the shuffle windows copied out the samples aliasing it (see
// mapping). Collections come often enough on their own; asking for one
// when the pool ran dry cost more CPU than it saved.
//
// With an S3 source allowed, the daemon takes the cache's budget of this
// memory at start (takeAhead), which a first epoch would otherwise take
// page by page.
type shardMem struct {
	limit int64

	mu     sync.Mutex
	free   map[int64][]*memSlot // free buffers, by class
	held   int64                // bytes of buffers mapped, handed out and free
	closed bool
	// region is the memory taken ahead (takeAhead), carved into buffers
	// as shards come: carved bytes of it are handed out, ready bytes
	// have their pages.
	region        []byte
	carved, ready int64
	// cachedHeap is the bytes of the cache's shards in the Go heap
	// (small ones, decoded ones, those the pool had no room for): the
	// pool keeps its buffers and these under its limit together, so
	// that free buffers do not sit beside heap shards that took their
	// place in the cache.
	cachedHeap int64

	reused atomic.Int64 // buffers handed out again, for tests and metrics

	// kept is the bytes of buffers the cache let go that shuffle
	// windows keep aliasing (assembler.unalias), all sessions together,
	// within room: the pool's room beyond the cache, which buffers
	// not yet collected share. Unlike those, kept buffers do not come
	// back at a collection; past the room, shards are read into the heap,
	// as when collections lag.
	kept atomic.Int64
	room int64

	// onHeld is told the bytes mapped whenever they change (report): the
	// daemon lowers the Go heap's soft limit by them, since the garbage
	// collector does not see this memory.
	onHeld   func(int64)
	reportMu sync.Mutex
	reported int64 // under reportMu
}

// poolAbove is the shard size from which shards are read into pooled
// buffers: each buffer is an area of the address space (as a mapping is,
// see mapAbove), and the heap serves small ones well.
var poolAbove int64 = 1 << 20

// shardMemSlack is the pool's least room beyond the cache's budget
// (which counts a pooled shard's whole buffer): shards read ahead, not
// yet in the cache, and those it let go not yet collected. A service
// gives it a session's read-ahead budget when that is more (slack):
// with less, a first epoch through a cache smaller than the dataset
// read a third of its shards into new memory while evicted ones waited
// for a collection.
const shardMemSlack = 64 << 20

// slack is the pool's room beyond the cache's budget for a read-ahead
// budget of readAhead bytes a session.
func slack(readAhead int64) int64 { return max(readAhead, shardMemSlack) }

// memSlot is a pooled buffer, the argument of its mapping's cleanup: it
// must not point back at the mapping, or the mapping would never be
// unreachable.
type memSlot struct {
	buf    []byte // the whole buffer, of its class's size
	carved bool   // a piece of the region, not a mapping of its own
}

// newShardMem makes a pool for a cache of cache bytes, with room bytes
// beyond it (see slack).
func newShardMem(cache, room int64) *shardMem {
	m := &shardMem{free: map[int64][]*memSlot{}}
	m.resize(cache, room)
	return m
}

// resize sets the pool's limit, before it hands out anything.
func (m *shardMem) resize(cache, room int64) { m.limit, m.room = cache+room, room }

// keepBudget is how many bytes of buffers a session that keeps mine of
// them aliased may keep.
func (m *shardMem) keepBudget(mine int64) int64 {
	return max(0, m.room-(m.kept.Load()-mine))
}

// sizeClass rounds n up to whole pages and then to four significant
// bits.
func sizeClass(n int64) int64 {
	const page = 4096
	p := (n + page - 1) / page
	if s := bits.Len64(uint64(p)) - 4; s > 0 {
		p = (p + 1<<s - 1) >> s << s
	}
	return p * page
}

// buf returns size bytes for a shard: a pooled buffer, or the Go heap's
// when the shard is small, the pool full, or m nil. A pooled buffer's
// bytes are not zeroed: the caller overwrites them all.
func (m *shardMem) buf(size int64) shardBytes {
	if m != nil && size >= poolAbove && int64(int(size)) == size {
		if slot := m.take(sizeClass(size)); slot != nil {
			mp := &mapping{data: slot.buf[:size:size], slot: slot}
			runtime.AddCleanup(mp, m.put, slot)
			return shardBytes{b: mp.data, m: mp}
		}
	}
	heap := make([]byte, size)
	prefault(heap)
	return heapBytes(heap)
}

// cached counts a shard the cache now holds, if its bytes are the
// heap's (see cachedHeap), unmapping free buffers to make room for it.
func (m *shardMem) cached(d shardBytes) {
	if d.m == nil || d.m.borrowed() || d.m.counted.Swap(true) {
		return
	}
	defer m.report() // shed
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cachedHeap += int64(len(d.m.data))
	m.shed(0)
}

// uncached counts a shard the cache let go (see cached).
func (m *shardMem) uncached(d shardBytes) {
	if d.m == nil || !d.m.counted.Swap(false) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cachedHeap -= int64(len(d.m.data))
}

// full says whether the pool's buffers and the cache's heap shards leave
// no room for n bytes more. Call with mu.
func (m *shardMem) full(n int64) bool { return m.held+m.cachedHeap+n > m.limit }

// heapBytes is a shard's bytes in the Go heap, with a mapping that
// carries the cache's eviction to the samples aliasing them.
func heapBytes(b []byte) shardBytes {
	return shardBytes{b: b, m: &mapping{data: b}}
}

// take pops a free buffer of the class, or carves one out of what the
// region has ready, or uses a free one up to twice as large, or maps a
// new one while the pool holds less than its limit; nil when none.
func (m *shardMem) take(class int64) *memSlot {
	defer m.report() // shed or mapped
	m.mu.Lock()
	if s := m.pop(class); s != nil {
		m.mu.Unlock()
		m.reused.Add(1)
		return s
	}
	if m.carved+class <= m.ready {
		b := m.region[m.carved : m.carved+class : m.carved+class]
		m.carved += class
		m.mu.Unlock()
		return &memSlot{buf: b, carved: true}
	}
	if s := m.popLarger(class); s != nil {
		m.mu.Unlock()
		m.reused.Add(1)
		return s
	}
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.shed(class) // free buffers of other sizes, or beside the cache's heap shards, make room
	if m.held+class > m.limit {
		m.mu.Unlock()
		return nil
	}
	m.held += class
	m.mu.Unlock()
	b, err := mapAnon(class)
	if err != nil {
		m.mu.Lock()
		m.held -= class
		m.mu.Unlock()
		return nil
	}
	return &memSlot{buf: b}
}

// report tells onHeld the bytes mapped now: the latest, whatever the
// order callers come in.
func (m *shardMem) report() {
	if m.onHeld == nil {
		return
	}
	m.reportMu.Lock()
	defer m.reportMu.Unlock()
	m.mu.Lock()
	n := m.held
	m.mu.Unlock()
	if n != m.reported {
		m.reported = n
		m.onHeld(n)
	}
}

// shed unmaps free buffers while the pool's buffers and the cache's
// heap shards leave no room for n bytes more. What they hold grows only
// in take and cached, which call it: they stay under the limit, unless
// all of it is in use. Call with mu.
func (m *shardMem) shed(n int64) {
	for c := range m.free {
		for m.full(n) {
			s := m.pop(c)
			if s == nil {
				break
			}
			m.release(s)
		}
		if !m.full(n) {
			return
		}
	}
}

// pop takes a free buffer of the class. Call with mu.
func (m *shardMem) pop(class int64) *memSlot {
	l := m.free[class]
	if len(l) == 0 {
		return nil
	}
	s := l[len(l)-1]
	l[len(l)-1] = nil
	m.free[class] = l[:len(l)-1]
	return s
}

// popLarger takes the smallest free buffer larger than class, up to
// twice it: shards of a new size use the memory of an old one (the cache
// counting the whole buffer) rather than new pages. Call with mu.
func (m *shardMem) popLarger(class int64) *memSlot {
	best := int64(0)
	for c, l := range m.free {
		if c > class && c <= 2*class && len(l) > 0 && (best == 0 || c < best) {
			best = c
		}
	}
	if best == 0 {
		return nil
	}
	return m.pop(best)
}

// mapAnon maps size bytes of private memory and asks for its pages now
// (prefault), within the cap on mappings.
func mapAnon(size int64) ([]byte, error) {
	if liveMappings.Add(1) > mappingCap() {
		liveMappings.Add(-1)
		return nil, errNoMapping
	}
	b, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		liveMappings.Add(-1)
		return nil, err
	}
	prefault(b)
	return b, nil
}

// put takes a buffer back once nothing aliases it (its mapping's
// cleanup); a closed pool unmaps it.
func (m *shardMem) put(s *memSlot) {
	defer m.report()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		m.release(s)
		return
	}
	class := int64(len(s.buf))
	m.free[class] = append(m.free[class], s)
}

// release unmaps a buffer: a closed pool's, or one shed. Call with mu.
func (m *shardMem) release(s *memSlot) {
	m.held -= int64(len(s.buf))
	if s.carved {
		_ = unix.Munmap(s.buf) // a piece of the region, which goes piece by piece
		return
	}
	unmap(s.buf)
}

// close unmaps the free buffers and what the region has not handed out,
// and makes put unmap those still handed out, when their cleanup runs.
func (m *shardMem) close() {
	defer m.report()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	m.closed = true
	for _, l := range m.free {
		for _, s := range l {
			m.release(s)
		}
	}
	clear(m.free)
	if rest := m.region[m.carved:]; len(rest) > 0 {
		m.held -= int64(len(rest))
		_ = unix.Munmap(rest)
	}
	m.region, m.carved, m.ready = nil, 0, 0
}

// trim gives back the region past its first n bytes, whose pages were
// not taken (stopped, or refused).
func (m *shardMem) trim(n int64) {
	defer m.report()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed || n >= int64(len(m.region)) {
		return
	}
	_ = unix.Munmap(m.region[n:])
	m.held -= int64(len(m.region)) - n
	m.region = m.region[:n:n]
}

// regionStep is how much of the region takeAhead asks pages for at a
// time, so that shards use what is ready meanwhile and close stops it
// soon.
const regionStep = 64 << 20

// takeAhead maps n bytes (whole pages) of the pool's limit and asks the
// kernel for their pages, regionStep at a time, until stop is closed:
// the memory a first epoch from S3 would otherwise take page by page as
// shards come, taken before it (as the arena is). It returns how many
// bytes have their pages, and the error that stopped it early. The
// caller runs it once, and close after it returned.
func (m *shardMem) takeAhead(n int64, stop <-chan struct{}) (int64, error) {
	n = min(n, m.limit) &^ 4095
	if n <= 0 || int64(int(n)) != n {
		return 0, nil
	}
	b, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, fmt.Errorf("map %d bytes for shard buffers: %w", n, err)
	}
	m.mu.Lock()
	if m.closed || m.region != nil || m.full(n) {
		m.mu.Unlock()
		_ = unix.Munmap(b)
		return 0, nil
	}
	m.region = b
	m.held += n
	m.mu.Unlock()
	m.report()
	for off := int64(0); off < n; off += regionStep {
		select {
		case <-stop:
			m.trim(off)
			return off, nil
		default:
		}
		end := min(off+regionStep, n)
		err := unix.Madvise(b[off:end], unix.MADV_POPULATE_WRITE)
		if err != nil && !errors.Is(err, unix.EINVAL) { // EINVAL: before Linux 5.14, pages come as written
			m.trim(off)
			return off, fmt.Errorf("take %d bytes for shard buffers: %w", n, err)
		}
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			return off, nil
		}
		m.ready = end
		m.mu.Unlock()
	}
	return n, nil
}
