package staging

import (
	"cmp"
	"slices"
	"strings"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
)

// Snapshot is what the Manager holds at one moment, for `ckptd status`:
// the arena's use by kind, every open lease with its owner, and every save
// it knows of with its state.
type Snapshot struct {
	ArenaSize, ArenaUsed int64
	// The checkpoint path's share of ArenaUsed, by use: save regions
	// (leased or journaled), restore regions, and regions kept for gone or
	// expired clients whose processes may still write (see Owner).
	Staging, Restoring, Held int64
	// The hot tier: bytes held of its budget, and the rank shards held.
	HotBytes, HotBudget int64
	HotShards           int
	Leases              []LeaseSnapshot
	Saves               []SaveSnapshot
	Errors              map[string]uint64 // by operation
}

// LeaseSnapshot describes one open lease. ID is a prefix of the lease id,
// enough to tell leases apart in a listing and too short to use one.
type LeaseSnapshot struct {
	ID        string
	Kind      string // "save" or "restore"
	Peer      string // who holds it (Owner.Peer), "" for the daemon itself
	Bytes     int64
	Target    checkpoint.Target // of a save
	Journaled bool              // a save accepted and not yet durable
	Begun     time.Time
	Expires   time.Time // zero once journaled: it no longer expires
}

// SaveSnapshot is one rank's save as the Manager knows it.
type SaveSnapshot struct {
	Target checkpoint.Target
	State  State
	Since  time.Time // when it entered State
	Begun  time.Time // when the save was accepted (or replayed from the journal)
	Err    string    // why it failed, or the last transient error
}

// leaseIDShown is how much of a lease id a snapshot shows.
const leaseIDShown = 8

// Snapshot returns what the Manager holds now, leases and saves in the
// order they began.
func (mgr *Manager) Snapshot() Snapshot {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	s := Snapshot{ArenaSize: mgr.arena.Size(), ArenaUsed: mgr.arena.Used(), Errors: mgr.m.ErrorCounts()}
	for _, l := range mgr.leases.byID {
		ls := LeaseSnapshot{ID: l.id[:min(len(l.id), leaseIDShown)], Kind: l.kind.String(), Peer: l.peer,
			Bytes: l.region.Length, Begun: l.begun}
		if l.kind == saveLease {
			ls.Target, ls.Journaled = l.target, l.committed
			s.Staging += l.region.Length
		} else {
			s.Restoring += l.region.Length
		}
		if !l.committed {
			ls.Expires = l.expires
		}
		s.Leases = append(s.Leases, ls)
	}
	s.Held = mgr.leases.heldBytes()
	s.HotBytes, s.HotBudget, s.HotShards = mgr.tiers.Stats()
	mgr.saves.each(func(k saveKey, st *saveStatus) {
		t := checkpoint.Target{Job: k.job, Step: k.step, Rank: k.rank, WorldSize: st.worldSize, Attempt: k.attempt}
		ss := SaveSnapshot{Target: t, State: st.state, Since: st.updated, Begun: st.begun}
		if st.err != nil {
			ss.Err = st.err.Error()
		}
		s.Saves = append(s.Saves, ss)
	})
	slices.SortFunc(s.Leases, func(a, b LeaseSnapshot) int { return a.Begun.Compare(b.Begun) })
	slices.SortFunc(s.Saves, func(a, b SaveSnapshot) int {
		return cmp.Or(strings.Compare(a.Target.Job, b.Target.Job), cmp.Compare(a.Target.Step, b.Target.Step),
			cmp.Compare(a.Target.Rank, b.Target.Rank), strings.Compare(a.Target.Attempt, b.Target.Attempt))
	})
	return s
}
