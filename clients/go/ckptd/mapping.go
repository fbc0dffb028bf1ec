//go:build linux

package ckptd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// mapping is the client's view of the daemon's arena, or of its hot tier's
// file (read-only). The client maps the whole arena once and copies into
// it for every save; mapping per save would pay the page faults every
// time.
type mapping struct {
	mu    sync.Mutex
	mem   []byte
	id    string // the daemon's id of the file when this was mapped
	path  string
	ident string // "dev:ino" of the file mapped
}

// mapFile maps the arena file at path (writable), or the hot tier's
// (read-only), which must be size bytes (both as the daemon says), after
// checking that the daemon (uid daemonUID) made it: opened without following a symlink, a regular file owned by the
// daemon, writable by no one else outside its group, in a folder of the
// daemon's that others cannot write into. A daemon cannot make the client
// copy its weights over some other file.
func mapFile(path string, size int64, daemonUID int, writable bool) (*mapping, error) {
	if size <= 0 {
		return nil, fmt.Errorf("ckptd arena %s: size %d", path, size)
	}
	var dst unix.Stat_t
	if err := unix.Lstat(filepath.Dir(path), &dst); err != nil {
		return nil, fmt.Errorf("ckptd arena: %w", err)
	}
	if dst.Mode&unix.S_IFMT != unix.S_IFDIR || int(dst.Uid) != daemonUID || dst.Mode&0o002 != 0 {
		return nil, fmt.Errorf("%w: the arena's folder %s (uid %d, mode %o) is not a folder of the daemon's (uid %d) closed to others",
			ErrUntrustedDaemon, filepath.Dir(path), dst.Uid, dst.Mode&0o7777, daemonUID)
	}
	mode, prot, flags := os.O_RDONLY, unix.PROT_READ, unix.MAP_SHARED
	if writable {
		// The arena's pages all exist: map them now. The hot tier's file
		// has holes where no shard was kept; reading them would allocate.
		mode, prot, flags = os.O_RDWR, prot|unix.PROT_WRITE, flags|unix.MAP_POPULATE
	}
	f, err := os.OpenFile(path, mode|unix.O_NOFOLLOW, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("%w: the arena %s is a symbolic link, not the daemon's file", ErrUntrustedDaemon, path)
	}
	if err != nil {
		return nil, fmt.Errorf("ckptd arena: map: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("ckptd arena: map: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != daemonUID || st.Mode&0o002 != 0 {
		return nil, fmt.Errorf("%w: the arena %s (uid %d, mode %o) is not a regular file of the daemon's (uid %d) closed to others",
			ErrUntrustedDaemon, path, st.Uid, st.Mode&0o7777, daemonUID)
	}
	if st.Size != size {
		return nil, fmt.Errorf("ckptd arena %s: file is %d bytes, expected %d (was the daemon restarted with another size?)",
			path, st.Size, size)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), prot, flags)
	if err != nil {
		return nil, fmt.Errorf("ckptd arena: mmap %s (%d bytes): %w", path, size, err)
	}
	return &mapping{mem: mem, path: path, ident: fmt.Sprintf("%d:%d", st.Dev, st.Ino)}, nil
}

// bytes is the whole arena; region offsets index it directly. It is
// invalid after close.
func (m *mapping) bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mem
}

func (m *mapping) close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem == nil {
		return nil
	}
	err := unix.Munmap(m.mem)
	m.mem = nil
	return err
}
