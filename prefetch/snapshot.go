package prefetch

import (
	"slices"
	"time"
)

// Snapshot is what the prefetch service holds at one moment, for `ckptd
// status`.
type Snapshot struct {
	// ArenaShare is the datasets' share of the arena (--dataset-arena-bytes);
	// ArenaUsed is what ring slots and oversized batches hold of it.
	ArenaShare, ArenaUsed int64
	Sessions              []SessionSnapshot
}

// SessionSnapshot describes one open dataset session.
type SessionSnapshot struct {
	Peer      string // who opened it (Owner.Peer)
	Source    string
	Rank      int
	WorldSize int
	Epoch     int64
	LastUsed  time.Time
	Stats     Stats
	// RingSlots of RingMax; ReadAhead bytes of shards held ahead, of
	// ReadAheadTarget (the pacer's).
	RingSlots, RingMax         int
	ReadAhead, ReadAheadTarget int64
}

// Snapshot returns the service's sessions, oldest use first.
func (s *Service) Snapshot() Snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := Snapshot{ArenaShare: s.budget.size, ArenaUsed: s.budget.used.Load()}
	for _, ss := range s.sessions {
		snap.Sessions = append(snap.Sessions, SessionSnapshot{
			Peer: ss.peer, Source: ss.source, Rank: ss.spec.Rank, WorldSize: ss.spec.WorldSize,
			Epoch: ss.spec.Epoch, LastUsed: ss.lastUsed(), Stats: ss.it.Stats(),
			RingSlots: ss.ring.Slots(), RingMax: ss.ring.Max(),
			ReadAhead: ss.it.shardsMem.used.Load(), ReadAheadTarget: ss.it.pace.target(),
		})
	}
	slices.SortFunc(snap.Sessions, func(a, b SessionSnapshot) int { return a.LastUsed.Compare(b.LastUsed) })
	return snap
}
