package staging

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
)

// The persistent tier policy (ManagerConfig.PersistEvery, PersistInterval;
// see policy.go): every step is kept in the hot tier and sent to the peers,
// and only the steps the policy picks are also drained to storage and
// committed there. A step kept in memory only has
// no commit record; it is restorable while every one of its ranks is held
// by some sidecar of the job, which a restore learns from the sidecars'
// inventories (Peers.Inventory): no coordinator, as for storage commits.

// keepInMemory keeps a save of a step that is not persisted in the hot
// tier instead of draining it, and queues it for the peers. It returns
// false, leaving the save to the drain, when the hot tier cannot hold it:
// such a save is persisted rather than lost.
func (mgr *Manager) keepInMemory(l *lease) bool {
	t := l.target
	start := time.Now()
	m, data, release, err := mgr.tiers.HoldInMemory(t, l.layout, mgr.bytesOf(l), l.metadata, mgr.w.Options().ChunkSize, l.copyCheck)
	if errors.Is(err, checkpoint.ErrStagedChanged) || errors.Is(err, checkpoint.ErrInvalid) {
		mgr.refuse(l, err) // a save that can never be stored: not the whole step to storage
		return true
	}
	if err != nil {
		mgr.log.Warn(err.Error()+"; persisting a step the persistence policy would keep in memory, with its other ranks", "target", t)
		mgr.tiers.PersistInstead(t)
		return false
	}
	// Draining until it reaches the peers: see StateHot.
	mgr.endDrain(l, StateDraining, nil)
	if mgr.tiers.PersistedMeanwhile(t) { // a peer said so meanwhile
		mgr.tiers.PersistHeldNow(t)
	}
	mgr.log.Info("save kept in memory", "job", t.Job, "step", t.Step, "rank", t.Rank, "attempt", t.Attempt,
		"bytes", m.DataSize, "duration", time.Since(start), "persist_every", mgr.cfg.Tiers.PersistEvery)
	if !mgr.tiers.HasPeers() {
		release()
		mgr.markDone(keyOf(t), StateHot, nil)
		return true
	}
	mgr.tiers.ReplicateMemoryOnly(m, data, release, func(err error) {
		if err != nil {
			mgr.m.ReplicationFailures.Inc()
			mgr.markDone(keyOf(t), StateHot, err)
			return
		}
		mgr.markDone(keyOf(t), StateReplicated, nil)
	})
	return true
}

// persistHeld writes a shard kept in memory to storage and settles its
// step's commit, as a drain would: a peer persisted its step (see the
// tiers' policy).
func (mgr *Manager) persistHeld(held *checkpoint.Manifest, data []byte) {
	t := held.Target()
	layout, err := checkpoint.NewLayout(held.Tensors)
	if err != nil {
		mgr.log.Error("a shard kept in memory cannot be persisted", "target", t, "err", err)
		return
	}
	start := time.Now()
	mgr.saves.set(keyOf(t), StateDraining, nil)
	m, reused, err := mgr.writeRetrying(&checkpoint.Shard{Target: t, Layout: layout, Data: data, Metadata: held.Metadata})
	if err != nil {
		if err != errAbandoned {
			mgr.log.Error("persisting a shard kept in memory failed", "target", t, "err", err)
			mgr.markDone(keyOf(t), StateFailed, fmt.Errorf("persisting it when a peer persisted the step: %w", err))
		}
		return
	}
	mgr.log.Info("a peer persisted this step; persisted this sidecar's rank of it from memory", "target", t)
	mgr.recordDurable(t, m, reused, start)
	mgr.commitSettled(t)
}

// Tiers lists job's committed steps and the steps kept in memory only
// that this sidecar or its peers hold, oldest first, each with the tiers
// that can restore it.
func (mgr *Manager) Tiers(ctx context.Context, job string) ([]tiers.StepTiers, error) {
	store, err := mgr.jobStore(job)
	if err != nil {
		return nil, err
	}
	recs, err := store.Steps(ctx)
	if err != nil {
		return nil, err
	}
	return mgr.tiers.List(ctx, store.Job(), recs), nil
}

// PeerSide is what this sidecar serves its peers: its memory tiers.
func (mgr *Manager) PeerSide() *tiers.Tiers { return mgr.tiers }
