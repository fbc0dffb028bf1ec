package prefetch

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/ckptd/ckptd/budget"
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
		return budget.Wrap(fmt.Errorf("%w: %s needs %d bytes of the arena, more than the datasets' share of %d", ErrOverBudget, what, n, b.size), budget.DatasetShare)
	}
	wctx, cancel, wait := roomWait(ctx, wait)
	defer cancel()
	if err := b.sem.Acquire(wctx, n); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return budget.Wrap(fmt.Errorf("%w: %s needs %d bytes of the arena, and the other dataset sessions held the datasets' share of %d for %s; "+
			"close datasets, or raise the share (within the arena)", ErrOverBudget, what, n, b.size, wait), budget.DatasetShare, budget.StagingArena)
	}
	b.used.Add(n)
	return nil
}

// tryAcquire charges n bytes if that leaves at least keep bytes free,
// without waiting.
func (b *arenaBudget) tryAcquire(n, keep int64) bool {
	if !b.sem.TryAcquire(n + keep) {
		return false
	}
	b.sem.Release(keep)
	b.used.Add(n)
	return true
}

// roomWait bounds a wait for room by wait and, with a margin, by the
// caller's deadline: a refusal naming the budget and the fix tells the
// caller more than its own deadline passing, and a wait that ends just as
// the caller gives up races the caller's cancelling the call (the client
// then sees a reset stream, not an answer). It returns the wait it set.
func roomWait(ctx context.Context, wait time.Duration) (context.Context, context.CancelFunc, time.Duration) {
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)*9/10)
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	return wctx, cancel, wait.Round(time.Millisecond)
}

func (b *arenaBudget) release(n int64) {
	b.used.Add(-n)
	b.sem.Release(n)
}

// meter is a byte semaphore that keeps its peak use, for tests and
// metrics.
type meter struct {
	sem  *semaphore.Weighted
	size int64
	used atomic.Int64
	peak atomic.Int64
}

func newMeter(size int64) *meter { return &meter{sem: semaphore.NewWeighted(size), size: size} }

func (m *meter) Acquire(ctx context.Context, n int64) error {
	if err := m.sem.Acquire(ctx, n); err != nil {
		return err
	}
	u := m.used.Add(n)
	for p := m.peak.Load(); u > p && !m.peak.CompareAndSwap(p, u); p = m.peak.Load() {
	}
	return nil
}

func (m *meter) Release(n int64) {
	m.used.Add(-n)
	m.sem.Release(n)
}
