package tiers

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
)

// The persistent tier policy (Config.PersistEvery, PersistInterval; see
// policy.go): every step is kept in the hot tier and sent to the peers,
// and only the steps the policy picks are also drained to storage and
// committed there. A step kept in memory only has no commit record; it is
// restorable while every one of its ranks is held by some sidecar of the
// job, which a restore learns from the sidecars' inventories
// (Peers.Inventory): no coordinator, as for storage commits.

// heldStep is a step not in storage and whose ranks are held in memory,
// as the inventories of this sidecar and its peers show it.
type heldStep struct {
	step      int64
	attempt   string
	worldSize int
	created   time.Time        // the newest of its shards'
	holders   map[int][]holder // by rank: the sidecars holding a copy pinned to the original
	contested []int            // ranks whose copies could not be pinned (see pinned)
	differing int              // copies left out for differing from their rank's original
}

// holder is a sidecar holding a rank of a heldStep: its address ("" for
// this sidecar), the hash of the manifest it lists ("" if it does not
// say) and whether it says it holds the original.
type holder struct {
	addr, hash string
	original   bool
}

// pinned keeps the copies of a rank of a memory-only step that are its
// original, as no commit record pins them: with one sidecar listing the
// original, the copies of its hash; with none (its node is lost), all
// copies when they list one hash. A rank whose copies cannot be told
// apart that way (two originals, or holders that differ and no original)
// is contested and kept nowhere: a lying peer can make a step
// unrestorable from memory (an older one is restored), never have bytes
// other than the original's restored while the original's sidecar is up.
// This sidecar's own original is known for one, whatever peers claim.
// dropped is how many copies differed from the original.
func pinned(hs []holder) (kept []holder, dropped int, contested bool) {
	var origin *holder
	for i := range hs {
		switch {
		case !hs[i].original:
		case hs[i].addr == "":
			origin = &hs[i]
		case origin != nil && origin.addr == "":
		case origin != nil && *origin != hs[i]:
			contested = true
		default:
			origin = &hs[i]
		}
	}
	if contested && origin.addr != "" {
		return nil, 0, true
	}
	if origin == nil {
		for _, h := range hs[1:] {
			if h.hash != hs[0].hash {
				return nil, 0, true
			}
		}
		return hs, 0, false
	}
	want := origin.hash
	kept = slices.DeleteFunc(slices.Clone(hs), func(h holder) bool { return h.hash != want })
	return kept, len(hs) - len(kept), false
}

func (s *heldStep) whole() bool { return len(s.holders) == s.worldSize }

// heldSteps gathers the memory-only steps of job from this sidecar's hot
// tier and the inventories of the peers that answer, newest first (by
// step, then by the time their shards were saved).
func (t *Tiers) heldSteps(ctx context.Context, job string) []*heldStep {
	return memoryOnly(t.inventories(ctx, job))
}

// inventories is what this sidecar ("") and each peer that answers hold
// of job.
func (t *Tiers) inventories(ctx context.Context, job string) map[string][]HeldShard {
	byPeer := map[string][]HeldShard{"": t.hot.inventory(job)}
	if t.cfg.Peers != nil {
		inv, err := t.cfg.Peers.Inventory(ctx, job)
		if err != nil {
			t.log.Warn("some peers did not say what they hold", "job", job, "err", err)
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
				s = &heldStep{step: h.Step, attempt: h.Attempt, worldSize: h.WorldSize, holders: map[int][]holder{}}
				steps[key{h.Step, h.Attempt}] = s
			}
			if h.WorldSize != s.worldSize {
				continue // another world size under the same attempt: not this step's rank
			}
			s.holders[h.Rank] = append(s.holders[h.Rank], holder{addr, h.ManifestHash, h.Original})
			if h.Created.After(s.created) {
				s.created = h.Created
			}
		}
	}
	out := make([]*heldStep, 0, len(steps))
	for _, s := range steps {
		for rank, hs := range s.holders {
			kept, dropped, contested := pinned(hs)
			s.differing += dropped
			if contested {
				delete(s.holders, rank)
				s.contested = append(s.contested, rank)
				continue
			}
			// This sidecar ("") first: a restore reads its own memory before a peer's.
			slices.SortFunc(kept, func(a, b holder) int { return cmp.Compare(a.addr, b.addr) })
			s.holders[rank] = kept
		}
		slices.Sort(s.contested)
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *heldStep) int {
		return cmp.Or(cmp.Compare(b.step, a.step), b.created.Compare(a.created))
	})
	return out
}

// FromMemory finds rank's shard of a memory-only step: for latest, the
// newest whole one newer than the newest committed step (committed: -1
// when none is known); else the step asked
// for. found is false when no such step is whole; skipped is then (or
// even when found) the newest memory-only step passed over because some
// of its ranks are held nowhere.
func (t *Tiers) FromMemory(ctx context.Context, job string, step int64, latest bool, committed int64, rank int) (src Source, found bool, err error) {
	var skipped int64
	for _, s := range t.heldSteps(ctx, job) {
		if latest && s.step <= committed || !latest && s.step != step {
			continue
		}
		if !s.whole() {
			if len(s.contested) > 0 {
				t.log.Warn("sidecars list differing copies of some ranks of a step kept in memory only (two originals, or replicas "+
					"that differ with the original's sidecar gone): those ranks are not restored from memory",
					"job", job, "step", s.step, "ranks", s.contested)
			}
			skipped = max(skipped, s.step)
			continue
		}
		if s.differing > 0 {
			t.log.Warn("sidecars list copies of a step kept in memory only that differ from their rank's original; left out",
				"job", job, "step", s.step, "copies", s.differing)
		}
		if rank < 0 || rank >= s.worldSize {
			return Source{}, true, fmt.Errorf("%w: rank %d of step %d, saved at a world size of %d", checkpoint.ErrInvalid, rank, s.step, s.worldSize)
		}
		src, err := t.heldShard(ctx, job, s, rank)
		if err != nil && latest { // an inventory said more than its sidecar gives: not whole after all
			t.log.Warn("a sidecar's inventory lists this rank of a step kept in memory only, but no holder gives it; trying an older step",
				"job", job, "step", s.step, "rank", rank, "err", err)
			skipped = max(skipped, s.step)
			continue
		}
		src.Skipped = skipped
		return src, true, err
	}
	return Source{Skipped: skipped}, false, nil
}

// heldShard pins rank's shard of s here, or fetches it from a peer the
// inventories say holds it.
func (t *Tiers) heldShard(ctx context.Context, job string, s *heldStep, rank int) (Source, error) {
	for _, h := range s.holders[rank] {
		if h.addr == "" {
			if e, release := t.hot.getAny(job, s.step, rank, s.attempt); e != nil {
				return hotSource(e, release), nil
			}
			continue // evicted since the inventory
		}
		src, ok := t.FromPeers(ctx, job, s.step, rank, s.attempt, []string{h.addr})
		switch {
		case !ok:
		case h.hash != "" && src.hash != h.hash:
			src.Release()
			t.log.Warn("a sidecar serves a copy other than its inventory lists; trying the next", "peer", h.addr, "job", job, "step", s.step, "rank", rank)
		default:
			return src, nil
		}
	}
	return Source{}, budget.Wrap(fmt.Errorf("%w: step %d of job %q is kept in memory only (the persistence policy) and rank %d's copy went away while restoring",
		checkpoint.ErrStepNotFound, s.step, job, rank), budget.PersistPolicy)
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

// List lists job's committed steps (recs, from storage) and the steps
// kept in memory only that this sidecar or its peers hold, oldest first,
// each with the tiers that can restore it.
func (t *Tiers) List(ctx context.Context, job string, recs []*checkpoint.CommitRecord) []StepTiers {
	inv := t.inventories(ctx, job)
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
	return out
}

// sortTiers orders tiers strongest first: hot before peers.
func sortTiers(t []string) []string {
	slices.Sort(t) // "hot" < "peers"
	return t
}
