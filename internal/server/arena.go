package server

import (
	"context"
	"errors"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/prefetch"
)

// The core packages take the staging arena through interfaces of their own
// (staging.Arena, prefetch.Arena), with region types of their own, so
// that they import nothing of internal/arena. CheckpointArena and
// PrefetchArena fit the daemon's arena to them; regions convert as they
// are, since all three region types are an offset and a length.

// CheckpointArena is the daemon's arena a as a staging.Manager uses it.
func CheckpointArena(a *arena.Arena) staging.Arena { return checkpointArena{a} }

type checkpointArena struct{ *arena.Arena }

func (a checkpointArena) Alloc(ctx context.Context, n int64) (staging.Region, error) {
	r, err := a.Arena.Alloc(ctx, n)
	return staging.Region(r), checkpointError(err)
}

func (a checkpointArena) AllocWriter(ctx context.Context, n int64) (staging.Region, error) {
	r, err := a.Arena.AllocWriter(ctx, n)
	return staging.Region(r), checkpointError(err)
}

func (a checkpointArena) Seal(r staging.Region) { a.Arena.Seal(arena.Region(r)) }

func (a checkpointArena) Free(r staging.Region) error {
	return a.Arena.Free(arena.Region(r))
}

func (a checkpointArena) Reserve(r staging.Region) error {
	return a.Arena.Reserve(arena.Region(r))
}

func (a checkpointArena) Journal() staging.Journal {
	return checkpointJournal{a.Arena.Journal()}
}

type checkpointJournal struct{ *arena.Journal }

func (j checkpointJournal) List() ([]staging.JournalEntry, error) {
	entries, err := j.Journal.List()
	out := make([]staging.JournalEntry, len(entries))
	for i, e := range entries {
		out[i] = staging.JournalEntry(e)
	}
	return out, err
}

// checkpointError makes an Alloc error of the arena match the checkpoint
// sentinel of its kind too (the Manager tests for ErrArenaTooLarge),
// keeping its message and its chain.
func checkpointError(err error) error {
	switch {
	case errors.Is(err, arena.ErrTooLarge):
		return alsoIs{err, staging.ErrArenaTooLarge}
	case errors.Is(err, arena.ErrFull):
		return alsoIs{err, staging.ErrArenaFull}
	}
	return err
}

// alsoIs is an error that also matches target.
type alsoIs struct {
	error
	target error
}

func (e alsoIs) Unwrap() []error { return []error{e.error, e.target} }

// PrefetchArena is the daemon's arena a as a prefetch.Service uses it.
func PrefetchArena(a *arena.Arena) prefetch.Arena { return prefetchArena{a} }

type prefetchArena struct{ *arena.Arena }

func (a prefetchArena) Alloc(ctx context.Context, n int64) (prefetch.Region, error) {
	r, err := a.Arena.Alloc(ctx, n)
	return prefetch.Region(r), err
}

func (a prefetchArena) Free(r prefetch.Region) error {
	return a.Arena.Free(arena.Region(r))
}
