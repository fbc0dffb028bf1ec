package tiers

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
)

// hotTier keeps the local ranks' shards of a job's newest steps in the
// daemon's memory after they drain, so that a trainer restarted on the
// same node restores them at memory speed, and without storage at all when
// storage is down. It holds at most Budget bytes and Steps steps per job;
// the oldest steps go first, but never a shard being copied out. Shards
// are kept as their data space (the bytes a restore hands out) with the
// manifest whose chunk hashes verify them when they are served.
//
// The buffers of dropped shards are kept as spares (within the budget) and
// reused for the next shards of a size that fits: memory the kernel has
// not handed out yet costs a page fault per page on first touch, which on
// some machines takes longer than the copy into it.
type hotTier struct {
	mu      sync.Mutex
	budget  int64
	steps   int
	used    int64 // bytes of entries, and capacity of spares
	entries map[hotKey]*hotEntry
	spares  [][]byte
}

type hotKey struct {
	job  string
	step int64
	rank int
}

type hotEntry struct {
	m         *checkpoint.Manifest
	hash      string // of m as stored: what commit records pin
	data      []byte
	committed bool // the step is committed by m's attempt
	memory    bool // the step is kept in memory only (--persist-every, --persist-interval): no commit record will come
	origin    bool // saved through this sidecar (not a peer's replica): this sidecar persists it if told to
	pins      int  // restores copying out of data, replicas being sent: data is not reused while pinned
}

func newHotTier(budget int64, steps int) *hotTier {
	return &hotTier{budget: budget, steps: steps, entries: map[hotKey]*hotEntry{}}
}

func (h *hotTier) enabled() bool { return h != nil && h.budget > 0 }

// add keeps a shard, packed from its staging region, if it fits: older
// steps of its job beyond Steps go, then the oldest steps of any job until
// it fits. A shard that cannot fit is not kept (kept is false; data is
// packed all the same when it is within the budget, for the peers). A kept
// shard comes pinned: call release when done with data.
func (h *hotTier) add(m *checkpoint.Manifest, layout *checkpoint.Layout, region []byte, memory bool) (data []byte, release func(), kept bool) {
	if !h.enabled() || m.DataSize > h.budget {
		return nil, func() {}, false
	}
	data = h.buffer(m.Job, m.Step, m.DataSize)
	layout.Pack(region, data)
	release, kept = h.insert(m, data, hotFlags{memory: memory})
	return data, release, kept
}

// buffer returns n bytes for a shard of step of job: a spare that fits,
// once room is made as insert would, or new memory.
func (h *hotTier) buffer(job string, step, n int64) []byte {
	if !h.enabled() {
		return make([]byte, n)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.evict(job, step, n, true)
	if i := h.fit(n); i >= 0 {
		b := h.spares[i][:n]
		h.used -= int64(cap(b))
		h.spares = slices.Delete(h.spares, i, i+1)
		return b
	}
	return make([]byte, n)
}

// fit returns the index of the smallest spare that holds n bytes without
// wasting more than as much again, or -1. Call with mu.
func (h *hotTier) fit(n int64) int {
	best := -1
	for i, b := range h.spares {
		if c := int64(cap(b)); c >= n && c <= 2*n && (best < 0 || c < int64(cap(h.spares[best]))) {
			best = i
		}
	}
	return best
}

// hotFlags say what a shard kept in the tier is; see hotEntry.
type hotFlags struct{ committed, memory, origin bool }

// insert keeps data, m's data space, making room as add says; it reports
// whether it did, and returns the new entry pinned (release unpins it).
func (h *hotTier) insert(m *checkpoint.Manifest, data []byte, f hotFlags) (release func(), ok bool) {
	if !h.enabled() || m.DataSize > h.budget {
		return func() {}, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	k := hotKey{m.Job, m.Step, m.Rank}
	if old := h.entries[k]; old != nil && old.pins == 0 {
		h.drop(k, old)
	}
	if h.entries[k] != nil {
		return func() {}, false // the old one is being copied out; keep it
	}
	h.evict(m.Job, m.Step, m.DataSize, false)
	if h.used+m.DataSize > h.budget {
		return func() {}, false
	}
	e := &hotEntry{m: m, hash: m.Hash(), data: data, committed: f.committed, memory: f.memory, origin: f.origin, pins: 1}
	h.entries[k] = e
	h.used += m.DataSize
	return h.unpin(e), true
}

// evict makes room for n bytes of step of job: the job's steps beyond
// Steps go, then spares, then the oldest steps of any job, never a pinned
// shard. With keepFit a spare that fits n counts as room (buffer takes
// it). Call with mu.
func (h *hotTier) evict(job string, step int64, n int64, keepFit bool) {
	keys := make([]hotKey, 0, len(h.entries))
	for k := range h.entries {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b hotKey) int { return cmp.Compare(a.step, b.step) }) // oldest first
	steps := map[int64]bool{step: true}
	for _, k := range slices.Backward(keys) { // the job's newest steps, this one included, stay
		if k.job == job && len(steps) < h.steps {
			steps[k.step] = true
		}
	}
	for _, k := range keys {
		if e := h.entries[k]; e.pins == 0 && k.job == job && !steps[k.step] {
			h.drop(k, e)
		}
	}
	for {
		keep, room := -1, h.budget
		if keepFit {
			if keep = h.fit(n); keep >= 0 {
				room += int64(cap(h.spares[keep]))
			}
		}
		if h.used+n <= room || !h.freeSpare(keep) && !h.dropOldest(keys, job, step) {
			return
		}
	}
}

// freeSpare lets go of the largest spare but the one at keep; it reports
// whether there was one. Call with mu.
func (h *hotTier) freeSpare(keep int) bool {
	victim := -1
	for i, b := range h.spares {
		if i != keep && (victim < 0 || cap(b) > cap(h.spares[victim])) {
			victim = i
		}
	}
	if victim < 0 {
		return false
	}
	h.used -= int64(cap(h.spares[victim]))
	h.spares = slices.Delete(h.spares, victim, victim+1)
	return true
}

// dropOldest drops the oldest shard of keys still held and not pinned,
// step of job aside; it reports whether there was one. Call with mu.
func (h *hotTier) dropOldest(keys []hotKey, job string, step int64) bool {
	for _, k := range keys {
		if e := h.entries[k]; e != nil && e.pins == 0 && (k.job != job || k.step != step) {
			h.drop(k, e)
			return true
		}
	}
	return false
}

// drop forgets a shard nobody reads; its buffer becomes a spare.
func (h *hotTier) drop(k hotKey, e *hotEntry) {
	delete(h.entries, k)
	h.used -= e.m.DataSize
	if cap(e.data) > 0 {
		h.spares = append(h.spares, e.data[:0])
		h.used += int64(cap(e.data))
	}
}

// committed records which attempt committed step: its shards become
// servable, and those of other attempts go.
func (h *hotTier) committed(job string, step int64, attempt string) {
	if !h.enabled() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, e := range h.entries {
		if k.job != job || k.step != step {
			continue
		}
		if e.m.Attempt == attempt {
			e.committed = true
		} else if e.pins == 0 {
			h.drop(k, e)
		}
	}
}

// get pins the committed shard of rank of step (by attempt, when not
// empty) for copying out; release unpins it.
func (h *hotTier) get(job string, step int64, rank int, attempt string) (e *hotEntry, release func()) {
	return h.pin(job, step, rank, func(e *hotEntry) bool {
		return e.committed && (attempt == "" || e.m.Attempt == attempt)
	})
}

// getAny is get for a peer: committed or not (the asking sidecar checks
// the commit record) when it names the attempt, committed when not.
func (h *hotTier) getAny(job string, step int64, rank int, attempt string) (e *hotEntry, release func()) {
	return h.pin(job, step, rank, func(e *hotEntry) bool {
		return attempt != "" && e.m.Attempt == attempt || attempt == "" && e.committed
	})
}

// pin pins the shard of rank of step if ok says it will do.
func (h *hotTier) pin(job string, step int64, rank int, ok func(*hotEntry) bool) (e *hotEntry, release func()) {
	if !h.enabled() {
		return nil, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	e = h.entries[hotKey{job, step, rank}]
	if e == nil || !ok(e) {
		return nil, nil
	}
	e.pins++
	return e, h.unpin(e)
}

// unpin returns the func that undoes one pin of e.
func (h *hotTier) unpin(e *hotEntry) func() {
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		e.pins--
	}
}

// latest returns the newest committed step of job the tier holds rank's
// shard of.
func (h *hotTier) latest(job string, rank int) (int64, bool) {
	if !h.enabled() {
		return 0, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	best, ok := int64(0), false
	for k, e := range h.entries {
		if k.job == job && k.rank == rank && e.committed && (!ok || k.step > best) {
			best, ok = k.step, true
		}
	}
	return best, ok
}

// held is a pinned shard and the func that unpins it.
type held struct {
	e       *hotEntry
	release func()
}

// originals pins the shards of step of job by attempt that were saved
// through this sidecar and kept in memory only.
func (h *hotTier) originals(job string, step int64, attempt string) []held {
	if !h.enabled() {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []held
	for k, e := range h.entries {
		if k.job == job && k.step == step && e.origin && e.memory && e.m.Attempt == attempt {
			e.pins++
			out = append(out, held{e, h.unpin(e)})
		}
	}
	return out
}

// HeldShard is a shard a sidecar holds in memory, as its inventory lists
// it for the job's other sidecars.
type HeldShard struct {
	Step       int64
	Rank       int
	WorldSize  int
	Attempt    string
	Committed  bool // the step is committed in storage by Attempt
	MemoryOnly bool // the step is not drained (--persist-every, --persist-interval)
	Created    time.Time
}

// inventory lists the shards of job the tier holds.
func (h *hotTier) inventory(job string) []HeldShard {
	if !h.enabled() {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []HeldShard
	for k, e := range h.entries {
		if k.job == job {
			out = append(out, HeldShard{Step: k.step, Rank: k.rank, WorldSize: e.m.WorldSize, Attempt: e.m.Attempt,
				Committed: e.committed, MemoryOnly: e.memory, Created: e.m.Created})
		}
	}
	return out
}

// stats returns the bytes held, the budget and the shards held.
func (h *hotTier) stats() (used, budget int64, shards int) {
	if h == nil {
		return 0, 0, 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.used, h.budget, len(h.entries)
}
