package arena

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Pool is a shared-memory file whose pieces the daemon keeps data in
// that clients may read in place: the hot tier's shards. The daemon maps
// it read-write; clients map it read-only, so a restore can hand them
// the hot copy's own pages instead of copying it into the arena first.
//
// Unlike the arena it holds nothing that must survive the daemon (the
// hot tier is memory of the running process), so every OpenPool makes a
// new file, and a client of a crashed daemon still reading the old one
// reads unlinked pages no one writes. Pages are allocated when a piece
// is taken, not at open: the file costs memory as the hot tier fills, as
// the heap did, and a file system too small for a piece fails Take
// instead of a SIGBUS on the first write.
type Pool struct {
	path  string
	id    string
	size  int64
	alloc *allocator

	mu  sync.Mutex // guards f against Close; mem lives as long as the process
	mem []byte
	f   *os.File
}

// PoolFile is the pool's file name in the arena's folder.
const PoolFile = "hot"

// OpenPool makes the pool file in dir (the arena's folder, whose checks
// clients apply to it too), size bytes rounded up to a whole page, and
// maps it. The file is the daemon's user's alone to write: mode 0600.
func OpenPool(dir string, size int64) (*Pool, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: a pool of %d bytes", ErrInvalidRegion, size)
	}
	size = alignUp(size, pageSize)
	path := filepath.Join(dir, PoolFile)
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("arena: replace %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, privateMode)
	if err != nil {
		return nil, fmt.Errorf("arena: open %s: %w", path, err)
	}
	p := &Pool{path: path, size: size, alloc: newAllocator(size), f: f}
	p.alloc.pages = true
	if err = checkRoom(f, size); err == nil {
		err = f.Truncate(size)
	}
	if err == nil {
		p.mem, err = unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err == nil {
		p.id, err = fileID(f)
	}
	if err == nil {
		nonce := make([]byte, 8)
		_, _ = rand.Read(nonce) // never fails (crypto/rand panics rather)
		p.id += ":" + hex.EncodeToString(nonce)
	}
	if err != nil {
		if p.mem != nil {
			_ = unix.Munmap(p.mem)
		}
		f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("arena: pool %s: %w", path, err)
	}
	return p, nil
}

// Path is the file clients map (read-only); Size its length; ID its
// identity, which the leases of its pieces carry.
func (p *Pool) Path() string { return p.path }
func (p *Pool) Size() int64  { return p.size }
func (p *Pool) ID() string   { return p.id }

// Take hands out n > 0 bytes of the pool with their pages allocated, or
// reports that no free piece holds them or the file system has no room:
// Reserve, then Populate.
func (p *Pool) Take(n int64) ([]byte, bool) {
	b, ok := p.Reserve(n)
	if !ok || n == 0 {
		return b, ok
	}
	if p.Populate(b) != nil {
		p.Give(b)
		return nil, false
	}
	return b, true
}

// Reserve hands out n > 0 bytes of the pool, their pages not yet
// allocated: Populate them before writing there (a write to a page the
// file system has no room for would raise SIGBUS). It reports false when
// no free piece holds them. n == 0 gets an empty slice of no pool.
func (p *Pool) Reserve(n int64) ([]byte, bool) {
	if n == 0 {
		return []byte{}, true
	}
	if n < 0 || n > p.size {
		return nil, false
	}
	r, ok := p.alloc.tryTake(n)
	if !ok {
		return nil, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.f == nil {
		_ = p.alloc.freeRegion(r)
		return nil, false
	}
	return p.mem[r.Offset : r.Offset+n : r.Offset+n], true
}

// Populate allocates and maps the pages of b, a piece Reserve handed out,
// or fails (and logs why) where the file system has no room for them.
// It takes time in proportion to b's pages: its callers run it outside
// their locks.
func (p *Pool) Populate(b []byte) error {
	off, ok := p.Offset(b)
	if !ok {
		return fmt.Errorf("%w: populate memory not of the pool", ErrInvalidRegion)
	}
	err := p.populate(off, alignUp(int64(len(b)), pageSize))
	if err != nil {
		slog.Warn("arena: no memory for a piece of the hot tier's file; the shard is not kept there",
			"path", p.path, "bytes", len(b), "err", err)
	}
	return err
}

// populate allocates and maps the pages of [off, off+n) (page-aligned).
// The mapping lives as long as the process, so only the fallback, which
// needs the file, takes mu.
func (p *Pool) populate(off, n int64) error {
	err := unix.Madvise(p.mem[off:off+n], unix.MADV_POPULATE_WRITE)
	if errors.Is(err, unix.EINVAL) { // before Linux 5.14: allocate them; the writes map them
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.f == nil {
			return ErrClosed
		}
		err = unix.Fallocate(int(p.f.Fd()), 0, off, n)
	}
	return err
}

// Fits reports whether a Reserve of n bytes would find a free piece.
func (p *Pool) Fits(n int64) bool {
	if n <= 0 {
		return n == 0
	}
	return p.alloc.fits(n)
}

// Give takes back a piece Reserve or Take handed out; its pages stay
// allocated for the next one (the heap's spares did the same).
func (p *Pool) Give(b []byte) {
	if off, ok := p.Offset(b); ok {
		if err := p.alloc.freeRegion(Region{Offset: off, Length: int64(len(b))}); err != nil && !errors.Is(err, ErrClosed) {
			panic(fmt.Sprintf("arena: pool give: %v", err)) // a piece given twice: the hot tier's books are wrong
		}
	}
}

// Offset returns where b, a piece Take handed out, starts in the file;
// false for memory not of the pool (and empty pieces).
func (p *Pool) Offset(b []byte) (int64, bool) {
	if cap(b) == 0 {
		return 0, false
	}
	base := uintptr(unsafe.Pointer(unsafe.SliceData(p.mem))) // set at open, never unmapped
	at := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	if at < base || at-base >= uintptr(p.size) || int64(at-base)+int64(len(b)) > p.size {
		return 0, false
	}
	return int64(at - base), true
}

// Close removes the pool's file and takes no more pieces. The mapping
// stays until the process exits: a peer's replica being sent or a
// restore being verified as the daemon stops may still read a piece, and
// unmapping under them would crash the daemon instead of letting it end.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.f == nil {
		return nil
	}
	p.alloc.close()
	err := p.f.Close()
	p.f = nil
	if rmErr := os.Remove(p.path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) {
		err = errors.Join(err, rmErr)
	}
	return err
}
