package arena

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Mapping is a client's view of the arena. The client maps the whole arena
// once and copies into it for every save; mapping per save would pay the
// page faults every time.
type Mapping struct {
	mu  sync.Mutex
	mem []byte
	id  string
}

// Map maps the arena file at path, which must be size bytes (both as told
// by the daemon). The pages are populated up front so that the first save's
// copy runs at memory speed.
func Map(path string, size int64) (*Mapping, error) {
	if size <= 0 {
		return nil, fmt.Errorf("%w: map %s with size %d", ErrInvalidRegion, path, size)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("arena: map: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("arena: map: %w", err)
	}
	if fi.Size() != size {
		return nil, fmt.Errorf("arena: map %s: file is %d bytes, expected %d (was the daemon restarted with another size?)",
			path, fi.Size(), size)
	}
	id, err := fileID(f)
	if err != nil {
		return nil, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("arena: mmap %s (%d bytes): %w", path, size, err)
	}
	return &Mapping{mem: mem, id: id}, nil
}

// ID identifies the mapped file, as Arena.ID does on the daemon's side.
func (m *Mapping) ID() string { return m.id }

// Bytes is the whole arena; region offsets index it directly. It is invalid
// after Close.
func (m *Mapping) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mem
}

// Close unmaps the arena; closing twice is a no-op.
func (m *Mapping) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem == nil {
		return nil
	}
	err := unix.Munmap(m.mem)
	m.mem = nil
	if err != nil {
		return fmt.Errorf("arena: munmap: %w", err)
	}
	return nil
}
