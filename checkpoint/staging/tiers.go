package staging

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
)

// The persistent tier policy (ManagerConfig.PersistEvery, PersistInterval;
// see policy.go): every step is kept in the hot tier and sent to the peers,
// and only the steps the policy picks are also drained to storage and
// committed there. A step kept in memory only has
// no commit record; it is restorable while every one of its ranks is held
// by some sidecar of the job, which a restore learns from the sidecars'
// inventories (Peers.Inventory): no coordinator, as for storage commits.

// memoryTier reports whether some steps may be kept in memory only.
func (mgr *Manager) memoryTier() bool {
	return mgr.hot.enabled() && (mgr.cfg.PersistEvery > 1 || mgr.cfg.PersistInterval > 0)
}

// keepInMemory keeps a save of a step that is not persisted in the hot
// tier instead of draining it, and queues it for the peers. It returns
// false, leaving the save to the drain, when the hot tier cannot hold it:
// such a save is persisted rather than lost.
func (mgr *Manager) keepInMemory(l *lease) bool {
	t := l.target
	if l.layout.DataSize > mgr.cfg.HotBytes {
		mgr.log.Warn("the shard is larger than the hot tier (--hot-bytes); persisting a step the policy (--persist-every, --persist-interval) would keep in memory", "target", t)
		return false
	}
	start := time.Now()
	data := mgr.hot.buffer(t.Job, t.Step, l.layout.DataSize)
	l.layout.Pack(mgr.arena.Bytes()[l.region.Offset:l.region.Offset+l.size], data)
	m := checkpoint.MemoryManifest(t, l.layout, l.metadata, data, mgr.w.Options().ChunkSize)
	release, ok := mgr.hot.insert(m, data, hotFlags{memory: true, origin: true})
	if !ok {
		mgr.log.Warn("no room in the hot tier (restores hold it); persisting a step the policy (--persist-every, --persist-interval) would keep in memory", "target", t)
		return false
	}
	// Draining until it reaches the peers: see StateHot.
	mgr.endDrain(l, StateDraining, nil)
	if mgr.policy.persisted(stepKey{t.Job, t.Step, t.Attempt}) { // a peer said so meanwhile
		mgr.persistHeld(t.Job, t.Step, t.Attempt)
	}
	mgr.log.Info("save kept in memory", "job", t.Job, "step", t.Step, "rank", t.Rank, "attempt", t.Attempt,
		"bytes", m.DataSize, "duration", time.Since(start), "persist_every", mgr.cfg.PersistEvery)
	if mgr.cfg.Peers == nil {
		release()
		mgr.markDone(keyOf(t), StateHot, nil)
		return true
	}
	mgr.queueReplica(replica{m: m, data: data, memory: true, release: release})
	return true
}

// Inventory lists the shards of job this sidecar holds in memory, for a
// peer's restore.
func (mgr *Manager) Inventory(job string) ([]HeldShard, error) {
	if err := checkpoint.ValidateName("job", job); err != nil {
		return nil, err
	}
	return mgr.hot.inventory(job), nil
}

// heldStep is a step not in storage and whose ranks are held in memory,
// as the inventories of this sidecar and its peers show it.
type heldStep struct {
	step      int64
	attempt   string
	worldSize int
	created   time.Time        // the newest of its shards'
	holders   map[int][]string // by rank: the peers holding it, "" for this sidecar
}

func (s *heldStep) whole() bool { return len(s.holders) == s.worldSize }

// heldSteps gathers the memory-only steps of job from this sidecar's hot
// tier and the inventories of the peers that answer, newest first (by
// step, then by the time their shards were saved).
func (mgr *Manager) heldSteps(ctx context.Context, job string) []*heldStep {
	return memoryOnly(mgr.inventories(ctx, job))
}

// inventories is what this sidecar ("") and each peer that answers hold
// of job.
func (mgr *Manager) inventories(ctx context.Context, job string) map[string][]HeldShard {
	byPeer := map[string][]HeldShard{"": mgr.hot.inventory(job)}
	if mgr.cfg.Peers != nil {
		inv, err := mgr.cfg.Peers.Inventory(ctx, job)
		if err != nil {
			mgr.log.Warn("some peers did not say what they hold", "job", job, "err", err)
		}
		for addr, held := range inv {
			byPeer[addr] = held
		}
	}
	return byPeer
}

// memoryOnly gathers the memory-only steps of the inventories, newest
// first (see heldSteps).
func memoryOnly(byPeer map[string][]HeldShard) []*heldStep {
	type key struct {
		step    int64
		attempt string
	}
	steps := map[key]*heldStep{}
	for addr, held := range byPeer {
		for _, h := range held {
			if !h.MemoryOnly || h.Committed || h.Rank < 0 || h.Rank >= h.WorldSize { // committed: persisted after all
				continue
			}
			s := steps[key{h.Step, h.Attempt}]
			if s == nil {
				s = &heldStep{step: h.Step, attempt: h.Attempt, worldSize: h.WorldSize, holders: map[int][]string{}}
				steps[key{h.Step, h.Attempt}] = s
			}
			if h.WorldSize != s.worldSize {
				continue // another world size under the same attempt: not this step's rank
			}
			s.holders[h.Rank] = append(s.holders[h.Rank], addr)
			if h.Created.After(s.created) {
				s.created = h.Created
			}
		}
	}
	out := make([]*heldStep, 0, len(steps))
	for _, s := range steps {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *heldStep) int {
		return cmp.Or(cmp.Compare(b.step, a.step), b.created.Compare(a.created))
	})
	return out
}

// fromMemory finds rank's shard of a memory-only step: for latest, the
// newest whole one newer than the newest committed step (committed: -1
// when none is known); else the step asked
// for. found is false when no such step is whole; skipped is then (or
// even when found) the newest memory-only step passed over because some
// of its ranks are held nowhere.
func (mgr *Manager) fromMemory(ctx context.Context, job string, step int64, latest bool, committed int64, rank int) (src restoreSource, found bool, err error) {
	var skipped int64
	for _, s := range mgr.heldSteps(ctx, job) {
		if latest && s.step <= committed || !latest && s.step != step {
			continue
		}
		if !s.whole() {
			skipped = max(skipped, s.step)
			continue
		}
		if rank < 0 || rank >= s.worldSize {
			return restoreSource{}, true, fmt.Errorf("%w: rank %d of step %d, saved at a world size of %d", checkpoint.ErrInvalid, rank, s.step, s.worldSize)
		}
		src, err := mgr.heldShard(ctx, job, s, rank)
		src.skipped = skipped
		return src, true, err
	}
	return restoreSource{skipped: skipped}, false, nil
}

// heldShard pins rank's shard of s here, or fetches it from a peer the
// inventories say holds it.
func (mgr *Manager) heldShard(ctx context.Context, job string, s *heldStep, rank int) (restoreSource, error) {
	var from []string
	for _, addr := range s.holders[rank] {
		if addr == "" {
			if e, release := mgr.hot.getAny(job, s.step, rank, s.attempt); e != nil {
				return restoreSource{m: e.m, hot: e, release: release, tier: "hot"}, nil
			}
			continue // evicted since the inventory
		}
		from = append(from, addr)
	}
	if src, ok := mgr.fromPeers(ctx, job, s.step, rank, s.attempt, from); ok {
		return src, nil
	}
	return restoreSource{}, fmt.Errorf("%w: step %d of job %q is kept in memory only (--persist-every, --persist-interval) and rank %d's copy went away while restoring",
		checkpoint.ErrStepNotFound, s.step, job, rank)
}

// StepTiers is a step as `ckptd list --tiers` shows it: committed in
// storage, or kept in memory only, and where it can be restored from.
type StepTiers struct {
	Step       int64
	WorldSize  int
	Attempt    string
	Commit     *checkpoint.CommitRecord // nil for a step kept in memory only
	Tiers      []string                 // "storage", "hot" (this sidecar), "peers"
	RanksHeld  int                      // of a memory-only step: ranks some sidecar holds
	MemoryOnly bool
}

// Tiers lists job's committed steps and the steps kept in memory only
// that this sidecar or its peers hold, oldest first, each with the tiers
// that can restore it.
func (mgr *Manager) Tiers(ctx context.Context, job string) ([]StepTiers, error) {
	store, err := mgr.jobStore(job)
	if err != nil {
		return nil, err
	}
	recs, err := store.Steps(ctx)
	if err != nil {
		return nil, err
	}
	inv := mgr.inventories(ctx, store.Job())
	type key struct {
		step    int64
		attempt string
	}
	where := map[key][]string{} // the tiers holding some rank of a step's attempt
	for addr, held := range inv {
		tier := "peers"
		if addr == "" {
			tier = "hot"
		}
		for _, h := range held {
			k := key{h.Step, h.Attempt}
			if !slices.Contains(where[k], tier) {
				where[k] = append(where[k], tier)
			}
		}
	}
	var out []StepTiers
	for _, r := range recs {
		out = append(out, StepTiers{Step: r.Step, WorldSize: r.WorldSize, Attempt: r.Attempt, Commit: r,
			Tiers: append([]string{"storage"}, sortTiers(where[key{r.Step, r.Attempt}])...)})
	}
	for _, s := range memoryOnly(inv) {
		out = append(out, StepTiers{Step: s.step, WorldSize: s.worldSize, Attempt: s.attempt, MemoryOnly: true,
			RanksHeld: len(s.holders), Tiers: sortTiers(where[key{s.step, s.attempt}])})
	}
	slices.SortStableFunc(out, func(a, b StepTiers) int { return cmp.Compare(a.Step, b.Step) })
	return out, nil
}

// sortTiers orders tiers strongest first: hot before peers.
func sortTiers(t []string) []string {
	slices.Sort(t) // "hot" < "peers"
	return t
}
