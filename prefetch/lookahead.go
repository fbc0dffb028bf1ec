package prefetch

import (
	"math"
	"sort"
	"sync"
)

// lookahead knows the future: the order of an epoch is a pure function of
// (seed, epoch, world_size, rank), so each open iteration registers the
// shards it will read, in order (the rest of its epoch, then its rank's
// next epoch), and advances as it reads. Admission then follows Belady's
// rule across every iteration of the node: when the cache is full, the
// shard whose next read is farthest away goes, and a shard read later
// than everything cached is not admitted.
type lookahead struct {
	mu    sync.Mutex
	plans map[*plan]bool
}

// plan is one iteration's reads.
type plan struct {
	at  map[string][]int // the positions of each shard key, ascending
	pos int              // the read under way
}

func newLookahead() *lookahead { return &lookahead{plans: map[*plan]bool{}} }

// register adds an iteration that will read keys in order.
func (l *lookahead) register(keys []string) *plan {
	p := &plan{at: make(map[string][]int, len(keys))}
	if l == nil {
		return p
	}
	for i, k := range keys {
		p.at[k] = append(p.at[k], i)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.plans[p] = true
	return p
}

// advance says the iteration is consuming its i-th shard: the shards
// after it, read ahead or not, are still to come.
func (l *lookahead) advance(p *plan, i int) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	p.pos = max(p.pos, i)
}

func (l *lookahead) remove(p *plan) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.plans, p)
}

// distances returns a function giving how many reads away the next read
// of a key is, over every open iteration (math.MaxInt: none), or nil when
// no iteration is open.
func (l *lookahead) distances() func(key string) int {
	if l == nil { // off: admission's plain policy
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.plans) == 0 {
		return nil
	}
	type snap struct {
		at  map[string][]int
		pos int
	}
	plans := make([]snap, 0, len(l.plans))
	for p := range l.plans {
		plans = append(plans, snap{p.at, p.pos})
	}
	return func(key string) int {
		best := math.MaxInt
		for _, p := range plans {
			at := p.at[key]
			if i := sort.SearchInts(at, p.pos); i < len(at) {
				best = min(best, at[i]-p.pos)
			}
		}
		return best
	}
}
