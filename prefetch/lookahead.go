package prefetch

import (
	"math"
	"sort"
	"sync"
)

// lookahead knows the future: the order of an epoch is a pure function of
// (seed, epoch, world_size, rank), so each open iteration registers the
// shards it will read, in order (the rest of its epoch, then its rank's
// next epochs: see future), and advances as it looks them up. Admission
// then follows Belady's rule across every iteration of the node: when the
// cache is full, the shard whose next read is farthest away goes, and a
// shard whose next read (after the one that brought it in) comes later
// than everything cached is not admitted. A read's present is its lookup,
// not its consumption: a shard read ahead is held by its iteration from
// then on, whatever the cache does, so with reads far ahead the cache
// still judges by what is yet to be looked up.
type lookahead struct {
	mu    sync.Mutex
	plans map[*plan]bool
}

// plan is one iteration's reads.
type plan struct {
	at map[string][]int // the positions of each shard key, ascending
	// looked: every read before it has had its cache lookup, and holds its
	// shard or waits for storage: the cache no longer serves it, so only
	// the reads from looked on are the plan's future. early holds the
	// reads after looked already looked up (lookups end out of order).
	looked int
	early  map[int]bool
}

// readAt is the i-th read of a plan (p nil: a read no plan knows of).
type readAt struct {
	p *plan
	i int
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

// lookedUp says the cache lookup of read r is done: the read holds its
// shard, or waits for one from storage.
func (l *lookahead) lookedUp(r readAt) {
	if l == nil || r.p == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	p := r.p
	switch {
	case r.i < p.looked:
	case r.i > p.looked:
		if p.early == nil {
			p.early = map[int]bool{}
		}
		p.early[r.i] = true
	default:
		for p.looked++; p.early[p.looked]; p.looked++ {
			delete(p.early, p.looked)
		}
	}
}

func (l *lookahead) remove(p *plan) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.plans, p)
}

// distances returns how many reads away the next read of a cached key
// is, over every open iteration (math.MaxInt: none), and that of key, the
// shard read r just brought in: for r's own plan, its next read after r.
// next is nil when no iteration is open.
func (l *lookahead) distances(r readAt, key string) (next func(key string) int, mine int) {
	if l == nil { // off: admission's plain policy
		return nil, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.plans) == 0 {
		return nil, 0
	}
	type snap struct {
		at  map[string][]int
		now int
	}
	plans := make([]snap, 0, len(l.plans))
	mine = math.MaxInt
	for p := range l.plans {
		plans = append(plans, snap{p.at, p.looked})
		from := p.looked
		if p == r.p {
			from = max(from, r.i+1) // this read is served: its next one counts
		}
		mine = min(mine, nextRead(p.at[key], from, p.looked))
	}
	return func(key string) int {
		best := math.MaxInt
		for _, p := range plans {
			best = min(best, nextRead(p.at[key], p.now, p.now))
		}
		return best
	}, mine
}

// nextRead is how many reads after now the first of positions at or past
// from is (math.MaxInt: none).
func nextRead(positions []int, from, now int) int {
	if i := sort.SearchInts(positions, from); i < len(positions) {
		return positions[i] - now
	}
	return math.MaxInt
}
