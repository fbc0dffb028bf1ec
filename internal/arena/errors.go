package arena

import "errors"

// Sentinel errors; match them with errors.Is. The errors returned wrap them
// with the numbers needed to act on (sizes, offsets, paths).
var (
	// ErrTooLarge: the request can never fit, not even in an empty arena.
	ErrTooLarge = errors.New("arena: request larger than the arena")
	// ErrFull: the request could fit, but no room freed up before the
	// caller's context ended.
	ErrFull = errors.New("arena full")
	// ErrInvalidRegion: a size, offset or length that no region can have.
	ErrInvalidRegion = errors.New("arena: invalid region")
	// ErrNotAllocated: Free of a region that is not currently allocated
	// (double free, wrong offset or length).
	ErrNotAllocated = errors.New("arena: region not allocated")
	// ErrOverlap: Reserve of a region that overlaps one already in use.
	ErrOverlap = errors.New("arena: region overlaps one in use")
	// ErrInUse: another process holds the arena directory's lock.
	ErrInUse = errors.New("arena in use")
	// ErrNotOurs: the arena directory exists but is not ours to use (owned
	// by another user, a symlink, not a directory), e.g. planted by another
	// user at a predictable name in /dev/shm.
	ErrNotOurs = errors.New("arena directory not ours")
	// ErrClosed: the arena (or its journal) has been closed.
	ErrClosed = errors.New("arena closed")
	// ErrInvalidID: a journal id that is not a safe file name.
	ErrInvalidID = errors.New("arena journal: invalid id")
	// ErrJournalNotEmpty: Remove refused because staged saves would be lost.
	ErrJournalNotEmpty = errors.New("arena journal not empty")
)
