package prefetch

import (
	"sort"
	"sync"
	"time"

	"github.com/dgraph-io/ristretto/v2/z"
)

// admission decides which shards enter the cache and keeps its books:
// which keys are resident, in which group (a dataset: a source's backend
// and prefix), and when each group was last used. It makes the policy of
// the package comment: a shard is admitted when there is room, or when
// room can be made by evicting the shards of groups nobody has used for
// staleAfter. So a full
// cache keeps what it holds while that is being read (epoch scans of a
// dataset larger than the budget hit the fraction that fits), and a
// dataset that is no longer read gives way to the one that is.
//
// The cache never evicts on its own: admission reserves room first, so
// ristretto is never over budget. Its OnEvict and OnReject (a Set its
// buffers dropped; Close) still release the books, so they cannot drift.
type admission struct {
	mu         sync.Mutex
	budget     int64
	staleAfter time.Duration
	now        func() time.Time
	resident   int64
	groups     map[string]*group
	entries    map[uint64]*entry // by ristretto's key hash
}

type group struct {
	lastUse time.Time
	pins    int // iterations open on the dataset: never stale while any is
	keys    map[string]bool
}

type entry struct {
	key, group string
	conflict   uint64
	size       int64
}

func newAdmission(budget int64, staleAfter time.Duration) *admission {
	return &admission{
		budget: budget, staleAfter: staleAfter, now: time.Now,
		groups: map[string]*group{}, entries: map[uint64]*entry{},
	}
}

// pin and unpin count the iterations open on g, whose samples may alias
// its cached shards: a pinned group is never stale.
func (a *admission) pin(g string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.group(g).pins++
}

func (a *admission) unpin(g string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	gr := a.group(g)
	gr.pins--
	gr.lastUse = a.now()
}

// used marks g as being read now.
func (a *admission) used(g string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.group(g).lastUse = a.now()
}

func (a *admission) group(g string) *group {
	gr := a.groups[g]
	if gr == nil {
		gr = &group{keys: map[string]bool{}}
		a.groups[g] = gr
	}
	return gr
}

// reserve books size bytes for key in group g, if the policy admits it.
// It returns the keys that must be deleted from the cache to make the
// room (already gone from the books). With next (the open iterations'
// distances to each cached key's next read; mine, key's own), room is
// made by Belady's rule; without, from stale groups only.
func (a *admission) reserve(key, g string, size int64, next func(string) int, mine int) (evict []string, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if size > a.budget {
		return nil, false
	}
	if next != nil {
		return a.reserveLookahead(key, g, size, next, mine)
	}
	now := a.now()
	need := a.resident + size - a.budget
	var stale []string
	for name, gr := range a.groups {
		fresh := now.Sub(gr.lastUse) < a.staleAfter || gr.pins > 0
		if len(gr.keys) == 0 && !fresh && name != g {
			delete(a.groups, name) // forget datasets gone for good
			continue
		}
		if need <= 0 || name == g || fresh {
			continue
		}
		for k := range gr.keys {
			stale = append(stale, k)
			if e := a.entries[hashOf(k)]; e != nil {
				need -= e.size
			}
			if need <= 0 {
				break
			}
		}
	}
	if need > 0 {
		return nil, false // full of shards in use: keep them
	}
	a.admit(key, g, size, stale)
	return stale, true
}

// reserveLookahead makes room by evicting the cached shards read farthest
// in the future, as long as they are read later than key (whose next read
// is mine reads away); when that does not make room, key is not admitted.
// Call with mu.
func (a *admission) reserveLookahead(key, g string, size int64, next func(string) int, mine int) (evict []string, ok bool) {
	need := a.resident + size - a.budget
	if need > 0 {
		type cand struct {
			key  string
			size int64
			dist int
		}
		var cands []cand
		for _, e := range a.entries {
			cands = append(cands, cand{e.key, e.size, next(e.key)})
		}
		sort.Slice(cands, func(i, j int) bool { return cands[i].dist > cands[j].dist })
		for _, c := range cands {
			if need <= 0 || c.dist <= mine {
				break
			}
			evict = append(evict, c.key)
			need -= c.size
		}
		if need > 0 {
			return nil, false // everything cached is read sooner than key
		}
	}
	a.admit(key, g, size, evict)
	return evict, true
}

// admit drops evicted keys from the books and books key. Call with mu.
func (a *admission) admit(key, g string, size int64, evicted []string) {
	for _, k := range evicted {
		a.drop(hashOf(k))
	}
	h, conflict := z.KeyToHash(key)
	a.entries[h] = &entry{key: key, group: g, conflict: conflict, size: size}
	a.resident += size
	gr := a.group(g)
	gr.keys[key] = true
	gr.lastUse = a.now()
}

// release forgets an entry the cache no longer holds.
func (a *admission) release(h, conflict uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e := a.entries[h]; e != nil && (conflict == 0 || e.conflict == conflict) {
		a.drop(h)
	}
}

func (a *admission) drop(h uint64) {
	e := a.entries[h]
	if e == nil {
		return
	}
	delete(a.entries, h)
	a.resident -= e.size
	if gr := a.groups[e.group]; gr != nil {
		delete(gr.keys, e.key)
		if len(gr.keys) == 0 && gr.pins == 0 && a.now().Sub(gr.lastUse) >= a.staleAfter {
			delete(a.groups, e.group)
		}
	}
}

func hashOf(key string) uint64 {
	h, _ := z.KeyToHash(key)
	return h
}
