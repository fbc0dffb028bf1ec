package prefetch

import (
	"errors"
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
// of about one size share buffers. It
// holds at most limit bytes, handed out and free; past that, and below
// poolAbove, shards are read into the Go heap as before. A buffer comes
// back at the first garbage collection after its shard left the cache
// and the shuffle windows copied out the samples aliasing it (see
// mapping): the heap, which holds no shards, is collected often enough
// (asking for collections when the pool ran dry cost more than it gave).
type shardMem struct {
	limit int64

	mu     sync.Mutex
	free   map[int64][][]byte // free buffers, by class
	held   int64              // bytes of buffers mapped, handed out and free
	closed bool

	reused atomic.Int64 // buffers handed out again, for tests and metrics
}

// poolAbove is the shard size from which shards are read into pooled
// buffers: each buffer is an area of the address space (as a mapping is,
// see mapAbove), and the heap serves small ones well.
var poolAbove int64 = 1 << 20

// shardMemSlack is the pool's room beyond the cache's budget (which
// counts a pooled shard's whole buffer): shards read ahead, not yet in
// the cache, and those it let go not yet collected.
const shardMemSlack = 64 << 20

// memSlot is a pooled buffer, the argument of its mapping's cleanup: it
// must not point back at the mapping, or the mapping would never be
// unreachable.
type memSlot struct {
	buf []byte // the whole buffer, of its class's size
}

func newShardMem(limit int64) *shardMem {
	return &shardMem{limit: limit, free: map[int64][][]byte{}}
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
		if b := m.take(sizeClass(size)); b != nil {
			slot := &memSlot{buf: b}
			mp := &mapping{data: b[:size:size], slot: slot}
			runtime.AddCleanup(mp, m.put, slot)
			return shardBytes{b: mp.data, m: mp}
		}
	}
	heap := make([]byte, size)
	prefault(heap)
	return heapBytes(heap)
}

// heapBytes is a shard's bytes in the Go heap, with a mapping that
// carries the cache's eviction to the samples aliasing them.
func heapBytes(b []byte) shardBytes {
	return shardBytes{b: b, m: &mapping{data: b}}
}

// take pops a free buffer of the class, or maps a new one while the pool
// holds less than its limit; nil when neither.
func (m *shardMem) take(class int64) []byte {
	m.mu.Lock()
	if l := m.free[class]; len(l) > 0 {
		b := l[len(l)-1]
		m.free[class] = l[:len(l)-1]
		m.mu.Unlock()
		m.reused.Add(1)
		return b
	}
	if m.closed || m.held+class > m.limit {
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
	return b
}

// mapAnon maps size bytes of private memory and asks for its pages now,
// in one call (see prefault), within the cap on mappings.
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
	if err := unix.Madvise(b, unix.MADV_POPULATE_WRITE); err != nil && !errors.Is(err, unix.EINVAL) {
		unmap(b) // ENOMEM: no memory to back it; the heap will say so its own way
		return nil, err
	}
	return b, nil
}

// put takes a buffer back once nothing aliases it (its mapping's
// cleanup); a closed pool unmaps it.
func (m *shardMem) put(s *memSlot) {
	class := int64(len(s.buf))
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		m.held -= class
		unmap(s.buf)
		return
	}
	m.free[class] = append(m.free[class], s.buf)
}

// close unmaps the free buffers and makes put unmap those still handed
// out, when their cleanup runs.
func (m *shardMem) close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	for class, l := range m.free {
		for _, b := range l {
			m.held -= class
			unmap(b)
		}
	}
	clear(m.free)
}
