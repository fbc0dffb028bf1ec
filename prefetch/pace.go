package prefetch

import (
	"context"
	"sync"
	"time"
)

// pacer sizes an iteration's read-ahead from what it measures: the rate at
// which the consumer takes shards (bytes per second, as the assembler
// finishes them) and how long a shard takes to come from storage. Reads
// ahead are kept to
//
//	target = 2 × rate × fetch time + one shard
//
// within [2 shards, the read-ahead part of the budget]: by Little's law
// rate × fetch time is what must be in flight to keep up, and twice that
// lets the rate double before the pacer sees it. A consumer slower than
// storage then holds a couple of shards ahead, not the whole budget, and
// leaves the storage's bandwidth and the node's memory to the ranks that
// need them; one as fast as storage is bounded by the budget alone, as
// fetch times grow with the reads in flight. Until it has measured a few
// shards, and while every shard came from the cache, the pacer allows the
// whole budget: an epoch starts with all the lead it can get.
type pacer struct {
	ceiling int64
	wake    chan struct{} // a shard was consumed or fetched: the target moved
	now     func() time.Time

	mu       sync.Mutex
	last     time.Time // when the previous shard was consumed
	consumed int       // shards consumed
	interval float64   // EWMA of the seconds between consumptions
	size     float64   // EWMA of the shards' bytes
	fetch    float64   // EWMA of the seconds a read from storage took (0: none yet)
}

// paceWarmup is how many shards are consumed before the rate is trusted;
// paceAlpha weighs each new measure in the averages.
const (
	paceWarmup = 3
	paceAlpha  = 0.25
)

func newPacer(ceiling int64) *pacer {
	return &pacer{ceiling: ceiling, wake: make(chan struct{}, 1), now: time.Now}
}

func ewma(avg, x float64) float64 {
	if avg == 0 {
		return x
	}
	return avg + paceAlpha*(x-avg)
}

// consumedShard records that the consumer finished a shard of n bytes.
func (p *pacer) consumedShard(n int64) {
	p.mu.Lock()
	now := p.now()
	if !p.last.IsZero() {
		p.interval = ewma(p.interval, now.Sub(p.last).Seconds())
	}
	p.last = now
	p.consumed++
	p.size = ewma(p.size, float64(n))
	p.mu.Unlock()
	p.signal()
}

// fetched records a shard read from storage that took d.
func (p *pacer) fetched(d time.Duration) {
	p.mu.Lock()
	p.fetch = ewma(p.fetch, d.Seconds())
	p.mu.Unlock()
	p.signal()
}

func (p *pacer) signal() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// target is the bytes of shards to hold ahead now.
func (p *pacer) target() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.consumed < paceWarmup || p.fetch == 0 || p.interval == 0 {
		return p.ceiling
	}
	rate := p.size / p.interval
	t := int64(2*rate*p.fetch + p.size)
	return min(max(t, int64(2*p.size)), p.ceiling)
}

// wait returns once a shard of n bytes may be read ahead beside the held
// bytes held() reports: within the target, or when nothing is held (a
// shard larger than the target still goes, alone).
func (p *pacer) wait(ctx context.Context, n int64, held func() int64) error {
	for {
		h := held()
		if h == 0 || h+n <= p.target() {
			return nil
		}
		select {
		case <-p.wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
