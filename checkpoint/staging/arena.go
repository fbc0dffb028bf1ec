package staging

import "context"

// Region is a byte range of the staging arena: an offset into Arena.Bytes
// and a length.
type Region struct {
	Offset, Length int64
}

// Arena is the staging memory a Manager leases to saves and restores, with
// the journal that keeps accepted saves across a crash of the process.
// ckptd serve passes its shared-memory arena, which clients map. All
// methods must be safe for concurrent use.
type Arena interface {
	// Size is the arena's length in bytes; Used is how many of them the
	// regions handed out hold.
	Size() int64
	Used() int64
	// Bytes is the whole arena.
	Bytes() []byte
	// Reused reports whether the arena was kept from a process that died
	// with saves journaled: that process's clients may still be copying
	// into regions it had leased and never journaled, which this arena
	// sees as free (see ManagerConfig.ReuseFence).
	Reused() bool
	// Alloc returns a free region of n > 0 bytes, waiting for one until
	// ctx is done. Its error matches ErrArenaTooLarge when n can never
	// fit, and ErrArenaFull when no room was freed in time.
	Alloc(ctx context.Context, n int64) (Region, error)
	// AllocWriter is Alloc for a region a client writes into (a save's),
	// which the arena records as such until Seal or Free: after a crash,
	// only such regions wait out the fence (ManagerConfig.ReuseFence)
	// before others may use them.
	AllocWriter(ctx context.Context, n int64) (Region, error)
	// Seal says no client writes into r any more: its save is journaled.
	Seal(r Region)
	// Free gives back a region from Alloc or Reserve.
	Free(Region) error
	// Reserve marks a region that a journal entry names as in use; the
	// Manager reserves them all before it allocates.
	Reserve(Region) error
	// Journal records the saves accepted into the arena until they are
	// durable.
	Journal() Journal
}

// Journal keeps the saves a Manager accepted and has not yet made durable,
// one entry per save named by its lease id (32 hex digits), so that the
// next Manager on the same arena drains them.
type Journal interface {
	// Put writes or replaces entry id: after a crash the entry is there
	// whole, or as it was before.
	Put(id string, data []byte) error
	// Delete removes entry id.
	Delete(id string) error
	// List returns every entry, sorted by id.
	List() ([]JournalEntry, error)
	// Quarantine moves entry id, which cannot be replayed, out of the
	// journal for good, keeping it and reason for a post-mortem.
	Quarantine(id, reason string) error
}

// JournalEntry is one journaled save: its id and the Manager's encoding.
type JournalEntry struct {
	ID   string
	Data []byte
}
