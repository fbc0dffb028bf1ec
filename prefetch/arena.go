package prefetch

import "context"

// Region is a byte range of the arena: an offset into Arena.Bytes and a
// length.
type Region struct {
	Offset, Length int64
}

// Arena is the memory batches are delivered in: ckptd serve's staging
// arena, which trainers map and read in place. A Service takes its ring
// slots and the regions of oversized batches from it, within
// ServiceConfig.ArenaBytes. All methods must be safe for concurrent use.
type Arena interface {
	// Size is the arena's length in bytes.
	Size() int64
	// Path is the arena's file. Its folder, which also holds the journal
	// of staged saves, is never a dataset source (ServiceConfig.ArenaDir).
	Path() string
	// Bytes is the whole arena.
	Bytes() []byte
	// Alloc returns a free region of n > 0 bytes, waiting for one until
	// ctx is done; its errors are passed on to the caller.
	Alloc(ctx context.Context, n int64) (Region, error)
	// Free gives back a region from Alloc.
	Free(Region) error
}
