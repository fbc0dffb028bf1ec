package prefetch

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// mapAbove is the size above which a shard of a local source is mapped
// instead of read (a variable for tests). Reading a shard into new memory
// costs the daemon a copy out of the page cache and the faults of new
// pages (0.6 CPU-seconds per GB here); mapping the file costs only the
// page-table entries (0.04), and the cache's copy is then the page cache's
// pages themselves. Small shards are read: each mapping is an area of the
// address space, and there are at most vm.max_map_count of them.
var mapAbove int64 = 1 << 20

// mapping is a shard file mapped read-only and shared: its bytes are the
// page cache's. It is unmapped when unreachable (a cleanup), so whatever
// aliases its bytes -- the cache's entry, a pending shard, the samples
// cut from it -- holds the mapping too.
//
// A file truncated while mapped faults (SIGBUS) where its bytes are read;
// the goroutines that read shard bytes (the assembler, the ring copy) do
// so under readMapped, which turns that fault into ErrCorruptShard
// instead of a crash. A file rewritten in place shows its new bytes: the
// shards of a dataset are expected not to change while it is read.
//
// A shard read into memory has one too (see shardMem): a pooled buffer,
// whose slot goes back to the pool instead of being unmapped, or the Go
// heap's. When the cache evicts such a shard, the samples in a shuffle
// window that still alias it copy their bytes out (see unalias), so that
// a few stragglers do not keep a whole shard's memory, which the cache's
// budget no longer counts; but for the pooled buffers the window holds
// most of, up to its bound in bytes, which it treats alike when the cache
// did not take them. A mapped file's stay mapped (page cache the kernel
// may reclaim).
type mapping struct {
	data    []byte
	slot    *memSlot // a pooled buffer (nil: the heap's, or a file)
	file    bool
	evicted atomic.Bool // the cache let it go (memory only)
	counted atomic.Bool // in shardMem.cachedHeap
}

// borrowed says the bytes are not the Go heap's (a file's, a pooled
// buffer): whatever aliases them must keep the mapping.
func (m *mapping) borrowed() bool { return m != nil && (m.file || m.slot != nil) }

// Live mappings are capped at a quarter of vm.max_map_count: the Go
// runtime needs areas of its own to grow the heap, and failing that is
// fatal. Past the cap (or mappings not yet collected after eviction)
// shards are read instead.
var (
	liveMappings atomic.Int64
	mappingCap   = sync.OnceValue(func() int64 {
		n := int64(65530) // the kernel's default
		if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
			if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && v > 0 {
				n = v
			}
		}
		return n / 4
	})
)

// errNoMapping: this shard is read, not mapped (the cap on mappings).
var errNoMapping = errors.New("no mapping left")

// mapFile maps size bytes of f and asks the kernel to map what the page
// cache holds (and read the rest) now, in one call.
func mapFile(f *os.File, size int64) (*mapping, error) {
	if size <= 0 || int64(int(size)) != size {
		return nil, fmt.Errorf("map %s: size %d", f.Name(), size)
	}
	if liveMappings.Add(1) > mappingCap() {
		liveMappings.Add(-1)
		return nil, errNoMapping
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		liveMappings.Add(-1)
		return nil, fmt.Errorf("map %s: %w", f.Name(), err)
	}
	if err := unix.Madvise(data, unix.MADV_POPULATE_READ); err != nil && !errors.Is(err, unix.EINVAL) {
		// EFAULT: the file shrank under us; EINVAL: a kernel before 5.14,
		// which faults pages in as they are read instead.
		unmap(data)
		return nil, fmt.Errorf("%w: map %s: %w", ErrCorruptShard, f.Name(), err)
	}
	m := &mapping{data: data, file: true}
	runtime.AddCleanup(m, unmap, data)
	return m, nil
}

func unmap(b []byte) {
	_ = unix.Munmap(b)
	liveMappings.Add(-1)
}

// ErrShardChanged: a mapped shard's file was truncated while it was read.
var ErrShardChanged = fmt.Errorf("%w: the shard's file changed while it was read (truncated?)", ErrCorruptShard)

// readMapped runs f, which reads shard bytes, turning a memory fault (a
// mapped file truncated under us) into ErrShardChanged: the daemon
// fails the shard and goes on. Other panics pass through.
func readMapped(f func() error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			if _, fault := r.(interface{ Addr() uintptr }); !fault {
				panic(r)
			}
			err = fmt.Errorf("%w: %v", ErrShardChanged, r)
		}
	}()
	return f()
}
