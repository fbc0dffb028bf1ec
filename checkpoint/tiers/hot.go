package tiers

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
)

// hotTier keeps shards in the daemon's memory: the local ranks' shards of
// a job's newest steps after they drain, so that a trainer restarted on
// the same node restores them at memory speed (and without storage when
// storage is down), the shards of steps kept in memory only, and the
// replicas peers send. Shards are kept as their data space (the bytes a
// restore hands out) with the manifest whose chunk hashes verify them
// when they are served.
//
// It holds at most budget bytes, counting the capacity of every buffer it
// has: its shards', its spares' and those handed out to be filled
// (buffer), which a replica being received is. Room is made by dropping,
// never a pinned shard (one being copied out or sent):
//
//  1. a job's shards beyond its newest `steps` steps, when it gets a new
//     one;
//  2. spares;
//  3. the oldest shards kept (by when they were kept, across jobs), never
//     one of another job's newest step.
//
// A shard of a step kept in memory only (memory) newer than the newest
// step of its job this tier saw committed is protected from all three: it
// may be the newest step every rank of the job holds, which the trainer
// was told is saved, and it stays until a newer step of the job is
// committed. A shard that finds no room is not kept: a save is persisted
// instead, and a replica refused.
//
// The buffers of dropped shards are kept as spares (within the budget) and
// reused for the next shards of a size that fits: memory the kernel has
// not handed out yet costs a page fault per page on first touch, which on
// some machines takes longer than the copy into it. With mem (shared
// memory clients read in place) the buffers are its pieces instead, which
// keep their pages when given back; room is then also made until a piece
// of the size is free.
type hotTier struct {
	mu      sync.Mutex
	budget  int64
	steps   int
	mem     Memory // nil: the heap
	used    int64  // capacity of the shards' buffers, the spares and the buffers handed out
	entries map[hotKey]*hotEntry
	spares  [][]byte
	jobs    map[string]*hotJob
	seq     uint64 // entries kept so far: their age
}

type hotKey struct {
	job     string
	step    int64
	rank    int
	attempt string
}

func keyOf(m *checkpoint.Manifest) hotKey { return hotKey{m.Job, m.Step, m.Rank, m.Attempt} }

type hotEntry struct {
	m    *checkpoint.Manifest
	hash string // of m as stored: what commit records pin
	data []byte
	// committed: the step's commit record, as this sidecar read it, pins
	// m (never a peer's word).
	committed bool
	memory    bool   // the step is kept in memory only (--persist-every, --persist-interval): no commit record may come
	origin    bool   // saved through this sidecar (not a peer's replica): never replaced by one
	pins      int    // restores copying out of data, replicas being sent: data is not reused while pinned
	seq       uint64 // when it was kept, in order
}

// hotJob is what the tier knows of a job besides its shards: the newest
// step it saw committed, and the commit records of its recent steps (a
// replica that arrives after its step committed is marked committed when
// the record pins it).
type hotJob struct {
	committed int64 // -1: none seen
	records   map[int64]*checkpoint.CommitRecord
}

// maxRecords bounds the commit records kept per job; maxJobs the jobs
// known beyond those the tier holds shards of.
const (
	maxRecords = 16
	maxJobs    = 1024
)

// Errors of insert, which AcceptReplica words for the peer.
var (
	errHeld   = errors.New("held here already with other content")
	errPinned = errors.New("held here already and being read")
)

func newHotTier(budget int64, steps int, mem Memory) *hotTier {
	return &hotTier{budget: budget, steps: steps, mem: mem, entries: map[hotKey]*hotEntry{}, jobs: map[string]*hotJob{}}
}

func (h *hotTier) enabled() bool { return h != nil && h.budget > 0 }

// buffer hands out n bytes to fill with the shard k names, then keep
// (insert) or give back (giveBack): a spare that fits, once room is made
// as insert would, or new memory. They count against the budget from
// now on. ok is false when no room can be made.
//
// New pieces of shared memory get their pages after the lock is let go:
// a first piece of gigabytes takes a while to populate, and restores and
// replicas look the tier up meanwhile.
func (h *hotTier) buffer(k hotKey, n int64) (b []byte, ok bool) {
	b, fresh, ok := h.reserve(k, n)
	if !ok || !fresh || n == 0 {
		return b, ok
	}
	if h.mem.Populate(b) != nil {
		h.giveBack(b)
		return nil, false
	}
	return b, true
}

// reserve is buffer under the lock; fresh says b is a piece of mem still
// to populate.
func (h *hotTier) reserve(k hotKey, n int64) (b []byte, fresh, ok bool) {
	if !h.enabled() || n < 0 || n > h.budget {
		return nil, false, false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.makeRoom(k, n) {
		return nil, false, false
	}
	if i := h.fit(n); i >= 0 {
		b = h.spares[i][:n]
		h.spares = slices.Delete(h.spares, i, i+1)
		return b, false, true // counted already
	}
	if h.mem == nil {
		b = make([]byte, n)
	} else if b, ok = h.mem.Reserve(n); !ok {
		return nil, false, false
	}
	h.used += n
	return b, h.mem != nil, true
}

// giveBack takes back a buffer handed out and not kept: it becomes a
// spare.
func (h *hotTier) giveBack(b []byte) {
	if cap(b) == 0 {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.putBack(b)
}

// putBack makes b, a buffer of the tier's, a spare, or gives it back to
// mem. Call with mu.
func (h *hotTier) putBack(b []byte) {
	if h.mem == nil {
		h.spares = append(h.spares, b[:0])
		return
	}
	h.used -= int64(cap(b))
	h.mem.Give(b)
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
type hotFlags struct{ memory, origin bool }

// insert keeps data, m's data space, in a buffer buffer handed out; it
// returns the new entry pinned (release unpins it). A peer's replica
// (not origin) never replaces a shard held under the same key: the same
// bytes again are taken as kept, other ones refused (errHeld). A shard
// saved here replaces one not being read. When insert fails, data is
// given back.
func (h *hotTier) insert(m *checkpoint.Manifest, data []byte, f hotFlags) (release func(), err error) {
	k := keyOf(m)
	hash := m.Hash()
	h.mu.Lock()
	defer h.mu.Unlock()
	if old := h.entries[k]; old != nil {
		switch {
		case !f.origin && old.hash == hash:
			h.putBack(data)
			return func() {}, nil
		case !f.origin:
			err = errHeld
		case old.pins > 0:
			err = errPinned
		default:
			h.drop(k, old)
		}
	}
	if err != nil {
		h.putBack(data)
		return func() {}, err
	}
	h.seq++
	e := &hotEntry{m: m, hash: hash, data: data, memory: f.memory, origin: f.origin, pins: 1, seq: h.seq}
	if j := h.jobs[k.job]; j != nil {
		if rec := j.records[k.step]; rec != nil && rec.Attempt == k.attempt && pins(rec, k.rank, hash) {
			e.committed = true
		}
	}
	h.entries[k] = e
	return h.unpin(e), nil
}

// protected reports whether e is a shard of a step kept in memory only
// and newer than the newest step of its job seen committed. Call with mu.
func (h *hotTier) protected(k hotKey, e *hotEntry) bool {
	if !e.memory || e.committed {
		return false
	}
	j := h.jobs[k.job]
	return j == nil || k.step > j.committed
}

// makeRoom makes room for n more bytes for the shard k names (n less a
// spare that fits it, which buffer takes), as hotTier says; it reports
// whether there is room. Call with mu.
func (h *hotTier) makeRoom(k hotKey, n int64) bool {
	keys := make([]hotKey, 0, len(h.entries))
	newest := map[string]int64{k.job: k.step} // each job's newest step
	for ek := range h.entries {
		keys = append(keys, ek)
		if s, ok := newest[ek.job]; !ok || ek.step > s {
			newest[ek.job] = ek.step
		}
	}
	steps := map[int64]bool{k.step: true} // the job's newest steps, this one included
	slices.SortFunc(keys, func(a, b hotKey) int { return cmp.Compare(b.step, a.step) })
	for _, ek := range keys {
		if ek.job == k.job && len(steps) < h.steps {
			steps[ek.step] = true
		}
	}
	for _, ek := range keys {
		if e := h.entries[ek]; ek.job == k.job && !steps[ek.step] && e.pins == 0 && !h.protected(ek, e) {
			h.drop(ek, e)
		}
	}
	slices.SortFunc(keys, func(a, b hotKey) int { return cmp.Compare(h.seqOf(a), h.seqOf(b)) }) // oldest first, dropped ones last
	for {
		keep, need := h.fit(n), n
		if keep >= 0 {
			need = 0
		}
		if h.used+need <= h.budget && (h.mem == nil || h.mem.Fits(n)) {
			return true
		}
		if h.freeSpare(keep) {
			continue
		}
		dropped := false
		for _, ek := range keys {
			e := h.entries[ek]
			if e == nil || e.pins > 0 || h.protected(ek, e) || ek.step == newest[ek.job] || ek.job == k.job && ek.step == k.step {
				continue
			}
			h.drop(ek, e)
			dropped = true
			break
		}
		if !dropped {
			return false
		}
	}
}

// seqOf is when k's shard was kept, for ordering; shards no longer held
// sort last. Call with mu.
func (h *hotTier) seqOf(k hotKey) uint64 {
	if e := h.entries[k]; e != nil {
		return e.seq
	}
	return ^uint64(0)
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

// drop forgets a shard nobody reads; its buffer becomes a spare. Call
// with mu.
func (h *hotTier) drop(k hotKey, e *hotEntry) {
	delete(h.entries, k)
	h.putBack(e.data)
}

// committed records rec, the commit record of step of job as this
// sidecar read it: the shards it pins become servable, those of other
// attempts go, and the job's shards kept in memory only of older steps
// are no longer protected.
func (h *hotTier) committed(job string, rec *checkpoint.CommitRecord) {
	if !h.enabled() {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	j := h.jobs[job]
	if j == nil {
		h.forgetJobs()
		j = &hotJob{committed: -1, records: map[int64]*checkpoint.CommitRecord{}}
		h.jobs[job] = j
	}
	j.committed = max(j.committed, rec.Step)
	j.records[rec.Step] = rec
	for len(j.records) > maxRecords {
		delete(j.records, slices.Min(slices.Collect(maps.Keys(j.records))))
	}
	for k, e := range h.entries {
		if k.job != job || k.step != rec.Step {
			continue
		}
		if k.attempt == rec.Attempt {
			e.committed = e.committed || pins(rec, k.rank, e.hash)
		} else if e.pins == 0 {
			h.drop(k, e)
		}
	}
}

// pins reports whether rec names the manifest of hash for rank, a rank
// of its step.
func pins(rec *checkpoint.CommitRecord, rank int, hash string) bool {
	if rank < 0 || rank >= rec.WorldSize || rec.Version > 1 && rank >= len(rec.Manifests) {
		return false
	}
	return rec.Pins(rank, hash)
}

// forgetJobs bounds the jobs known: past maxJobs, those the tier holds
// no shard of are forgotten. Call with mu.
func (h *hotTier) forgetJobs() {
	if len(h.jobs) < maxJobs {
		return
	}
	held := map[string]bool{}
	for k := range h.entries {
		held[k.job] = true
	}
	for job := range h.jobs {
		if !held[job] {
			delete(h.jobs, job)
		}
	}
}

// holds reports whether the tier holds the shard k names.
func (h *hotTier) holds(k hotKey) bool {
	if !h.enabled() {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.entries[k] != nil
}

// get pins the committed shard of rank of step (by attempt, when not
// empty) for copying out; release unpins it.
func (h *hotTier) get(job string, step int64, rank int, attempt string) (e *hotEntry, release func()) {
	return h.pin(job, step, rank, attempt, func(e *hotEntry) bool { return e.committed })
}

// getAny is get for a peer: committed or not (the asking sidecar checks
// the commit record, or the inventories) when it names the attempt,
// committed when not.
func (h *hotTier) getAny(job string, step int64, rank int, attempt string) (e *hotEntry, release func()) {
	return h.pin(job, step, rank, attempt, func(e *hotEntry) bool { return attempt != "" || e.committed })
}

// pin pins the shard of rank of step (by attempt, when not empty) if ok
// says it will do.
func (h *hotTier) pin(job string, step int64, rank int, attempt string, ok func(*hotEntry) bool) (e *hotEntry, release func()) {
	if !h.enabled() {
		return nil, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if attempt != "" {
		e = h.entries[hotKey{job, step, rank, attempt}]
	} else {
		for k, c := range h.entries {
			if k.job == job && k.step == step && k.rank == rank && ok(c) {
				e = c
				break
			}
		}
	}
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
		if k.job == job && k.step == step && e.origin && e.memory && k.attempt == attempt {
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
	// ManifestHash is the hash of its manifest as stored ("" from peers
	// that do not say).
	ManifestHash string
	// Original: the holder's trainer saved it (a replica's holder says
	// false); what the copies of a memory-only step are pinned to.
	Original bool
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
			out = append(out, HeldShard{Step: k.step, Rank: k.rank, WorldSize: e.m.WorldSize, Attempt: k.attempt,
				Committed: e.committed, MemoryOnly: e.memory, Created: e.m.Created, ManifestHash: e.hash, Original: e.origin})
		}
	}
	return out
}

// stats returns the bytes held (every buffer's capacity: shards, spares
// and buffers being filled), the budget and the shards held.
func (h *hotTier) stats() (used, budget int64, shards int) {
	if h == nil {
		return 0, 0, 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.used, h.budget, len(h.entries)
}

// describe names k for messages.
func (k hotKey) String() string {
	return fmt.Sprintf("job %q step %d rank %d attempt %q", k.job, k.step, k.rank, k.attempt)
}
