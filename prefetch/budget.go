package prefetch

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"
)

// arenaBudget is the datasets' share of the staging arena: every ring
// slot and every region of an oversized batch is charged to it before it
// is allocated, so that dataset sessions can never take the room
// checkpoint saves are staged in.
type arenaBudget struct {
	sem  *semaphore.Weighted
	size int64
	used atomic.Int64
}

func newArenaBudget(size int64) *arenaBudget {
	return &arenaBudget{sem: semaphore.NewWeighted(size), size: size}
}

// acquire charges n bytes for what, waiting up to wait for others to give
// theirs back. Failing, it is ErrOverBudget naming --dataset-arena-bytes,
// or the caller's own ctx error when that ended first.
func (b *arenaBudget) acquire(ctx context.Context, n int64, wait time.Duration, what string) error {
	if n > b.size {
		return fmt.Errorf("%w: %s needs %d bytes of the arena, more than the %d of --dataset-arena-bytes", ErrOverBudget, what, n, b.size)
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := b.sem.Acquire(wctx, n); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%w: %s needs %d bytes of the arena, and the other dataset sessions held the %d of --dataset-arena-bytes for %s; "+
			"close datasets, or raise --dataset-arena-bytes (within --staging-bytes)", ErrOverBudget, what, n, b.size, wait)
	}
	b.used.Add(n)
	return nil
}

func (b *arenaBudget) release(n int64) {
	b.used.Add(-n)
	b.sem.Release(n)
}
