package tiers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/storage"
)

// Config configures the memory tiers.
type Config struct {
	// HotBytes is the memory for the hot tier (0: none): the local ranks'
	// shards of each job's newest HotSteps steps, kept after they drain,
	// so that a restore of one of them reads no storage, and the replicas
	// peers send.
	HotBytes int64
	HotSteps int
	// HotMemory, when set, is where the hot tier keeps its shards instead
	// of the heap: shared memory clients map read-only, so that a restore
	// can hand out the hot copy in place (Source.Hot, TakePin). It must hold
	// HotBytes.
	HotMemory Memory
	// PersistEvery, above 1, drains only the steps it divides to storage:
	// the others are kept in the hot tier and sent to the peers only (see
	// memory.go). PersistInterval, above 0, drains a step whenever that
	// long has passed since the last one drained (see policy.go). They
	// need HotBytes; without them every step is persisted.
	PersistEvery    int
	PersistInterval time.Duration
	// Peers, when set, gets every drained shard to keep replicas of, and
	// is asked for a shard the hot tier lacks before storage.
	Peers Peers
	// Backend is the job's storage: a replica waits there for its step's
	// commit record.
	Backend storage.Backend
	// PersistHeld writes a shard kept in memory to storage, as a drain
	// would, when a peer says it persisted the step (Tiers.PersistStep).
	PersistHeld func(m *checkpoint.Manifest, data []byte)
	// Failed counts a failed operation ("replicate").
	Failed func(op string)
	Logger *slog.Logger
}

// Memory is memory the hot tier keeps its shards in (Config.HotMemory).
// Reserve, Fits and Give are called under the hot tier's lock; Populate,
// which takes time in proportion to the pages, outside it.
type Memory interface {
	// Reserve hands out n bytes (their capacity n), or reports that there
	// is no free piece; Fits says whether a piece of n bytes is free.
	Reserve(n int64) ([]byte, bool)
	Fits(n int64) bool
	// Populate gives the pages of a piece Reserve handed out their memory
	// before it is written, or fails where there is none.
	Populate(b []byte) error
	// Give takes back what Reserve handed out.
	Give(b []byte)
}

// ErrNoRoom: the hot tier cannot take a replica (it has no budget, or no
// room that restores do not hold).
var ErrNoRoom = errors.New("no room in the hot tier")

// DefaultHotSteps is Config.HotSteps when it is not set; the daemon's flag
// defaults to it too.
const DefaultHotSteps = 2

// Tiers keeps checkpoint shards in memory: the hot tier of this sidecar,
// the replicas it sends to its peers and keeps for them, and the policy
// that keeps some steps in memory only. It owns the goroutines that
// replicate and tell peers of persisted steps; Close stops them.
type Tiers struct {
	cfg      Config
	log      *slog.Logger
	hot      *hotTier
	policy   *persistPolicy
	fetching chan struct{} // one shard fetched from peers at a time
	replicas chan replica  // drained shards for replicateLoop

	ctx    context.Context // cancelled at Close
	cancel context.CancelFunc
	mu     sync.Mutex // guards closing
	// closing refuses new background work once the daemon shuts down
	closing bool
	wg      sync.WaitGroup
}

// New starts the tiers (the replication loop, when there are peers).
func New(cfg Config) *Tiers {
	if cfg.HotSteps <= 0 {
		cfg.HotSteps = DefaultHotSteps
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Failed == nil {
		cfg.Failed = func(string) {}
	}
	t := &Tiers{
		cfg: cfg, log: cfg.Logger, hot: newHotTier(cfg.HotBytes, cfg.HotSteps, cfg.HotMemory), policy: newPersistPolicy(),
		fetching: make(chan struct{}, 1), replicas: make(chan replica, replicaQueue),
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	if cfg.Peers != nil {
		t.wg.Go(t.replicateLoop)
	}
	return t
}

// Refuse makes the tiers start no new background work (announcements,
// persisting held shards): the daemon is shutting down.
func (t *Tiers) Refuse() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closing = true
}

// Close stops replication and waits for the background work to end.
func (t *Tiers) Close() {
	t.Refuse()
	t.cancel()
	t.wg.Wait()
}

// background runs fn on a goroutine Close waits for, unless closing.
func (t *Tiers) background(fn func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closing {
		t.wg.Go(fn)
	}
}

// HotEnabled reports whether there is a hot tier.
func (t *Tiers) HotEnabled() bool { return t.hot.enabled() }

// HotBytes is the hot tier's budget.
func (t *Tiers) HotBytes() int64 { return t.cfg.HotBytes }

// Peers reports whether there are peers.
func (t *Tiers) HasPeers() bool { return t.cfg.Peers != nil }

// MemoryTier reports whether some steps may be kept in memory only.
func (t *Tiers) MemoryTier() bool {
	return t.hot.enabled() && (t.cfg.PersistEvery > 1 || t.cfg.PersistInterval > 0)
}

// Stats returns the bytes the hot tier holds, its budget and the shards
// it holds.
func (t *Tiers) Stats() (used, budget int64, shards int) { return t.hot.stats() }

// Keep keeps a drained shard, packed from its staging region, in the hot
// tier if it fits (see hotTier); kept, it comes pinned: call release
// when done with data. With a check (the client's MACs of what it
// copied), the packed copy is kept only if it has them: a region others
// can write may have changed since it was drained.
func (t *Tiers) Keep(m *checkpoint.Manifest, layout *checkpoint.Layout, region []byte, check *checkpoint.CopyCheck) (data []byte, release func(), kept bool) {
	data, ok := t.hot.buffer(keyOf(m), m.DataSize)
	if !ok {
		return nil, func() {}, false
	}
	layout.Pack(region, data)
	if check != nil && !check.Matches(data) {
		t.hot.giveBack(data) // the region changed since the drain read it
		return nil, func() {}, false
	}
	release, err := t.hot.insert(m, data, hotFlags{origin: true})
	if err != nil {
		return nil, func() {}, false
	}
	return data, release, true
}

// MarkCommitted records rec, the commit record of a step of job as this
// sidecar read it from storage: the shards it pins become servable, those
// of other attempts go, and older steps kept in memory only are no longer
// protected from eviction.
func (t *Tiers) MarkCommitted(job string, rec *checkpoint.CommitRecord) {
	t.hot.committed(job, rec)
}

// Latest returns the newest committed step of job whose rank's shard the
// hot tier holds.
func (t *Tiers) Latest(job string, rank int) (int64, bool) { return t.hot.latest(job, rank) }

// Inventory lists the shards of job this sidecar holds in memory, for a
// peer's restore.
func (t *Tiers) Inventory(job string) ([]HeldShard, error) {
	if err := checkpoint.ValidateName("job", job); err != nil {
		return nil, err
	}
	return t.hot.inventory(job), nil
}

// Persists reports whether target's step goes to storage, telling the
// peers when the interval decided it.
func (t *Tiers) Persists(target checkpoint.Target) bool {
	every, interval := int64(t.cfg.PersistEvery), t.cfg.PersistInterval
	if !t.hot.enabled() || every <= 1 && interval <= 0 {
		return true
	}
	k := stepKey{target.Job, target.Step, target.Attempt}
	persist, announce := t.policy.decide(k, every, interval, time.Now())
	if announce {
		t.announce(k)
	}
	return persist
}

// announce tells the peers, in the background, that this sidecar
// persists k's step.
func (t *Tiers) announce(k stepKey) {
	if t.cfg.Peers == nil {
		return
	}
	t.background(func() {
		ctx, cancel := context.WithTimeout(t.ctx, replicateTimeout)
		defer cancel()
		if err := t.cfg.Peers.Persist(ctx, k.job, k.step, k.attempt); err != nil {
			t.cfg.Failed("replicate")
			t.log.Warn("could not tell every peer that this step is persisted", "job", k.job, "step", k.step, "err", err)
		}
	})
}

// PersistInstead records that target's step, which the policy kept in
// memory, is persisted after all, this sidecar's memory having no room
// for a save of it: its ranks held here are persisted too, from memory,
// and the peers are told, so that the step commits and the steps kept in
// memory before it may go.
func (t *Tiers) PersistInstead(target checkpoint.Target) {
	k := stepKey{target.Job, target.Step, target.Attempt}
	if t.policy.tell(k, time.Now()) {
		t.persistHeld(k.job, k.step, k.attempt)
	}
	t.announce(k)
}

// PersistStep is a peer's word that it persisted step of job by attempt:
// this sidecar persists its own ranks of it too, those it kept in memory
// from the hot tier (Config.PersistHeld), and those still to come as they
// drain.
func (t *Tiers) PersistStep(job string, step int64, attempt string) error {
	target := checkpoint.Target{Job: job, Step: step, WorldSize: 1, Attempt: attempt}
	if err := target.Validate(); err != nil {
		return err
	}
	if t.policy.tell(stepKey{job, step, attempt}, time.Now()) {
		t.persistHeld(job, step, attempt)
	}
	return nil
}

// PersistedMeanwhile reports whether a peer said it persisted target's
// step since it was decided to stay in memory here: the caller keeping it
// in memory persists it then (PersistHeldNow).
func (t *Tiers) PersistedMeanwhile(target checkpoint.Target) bool {
	return t.policy.persisted(stepKey{target.Job, target.Step, target.Attempt})
}

// PersistHeldNow persists this sidecar's own shards of target's step kept
// in memory, as PersistStep does.
func (t *Tiers) PersistHeldNow(target checkpoint.Target) {
	t.persistHeld(target.Job, target.Step, target.Attempt)
}

// persistHeld drains this sidecar's own shards of a step it kept in
// memory, from the hot tier (pinned meanwhile).
func (t *Tiers) persistHeld(job string, step int64, attempt string) {
	for _, o := range t.hot.originals(job, step, attempt) {
		t.background(func() {
			defer o.release()
			t.cfg.PersistHeld(o.e.m, o.e.data)
		})
	}
}

// HoldInMemory keeps a save of a step that is not persisted in the hot
// tier: packed from its staging region, with a memory manifest (chunks of
// chunkSize). It fails, leaving the save to the drain, when the hot tier
// cannot hold it: such a save is persisted rather than lost. Held, it
// comes pinned: call release when done with data. With a check (the
// client's hashes of what it copied) it holds the save only if its copy
// hashes the same, and fails with checkpoint.ErrStagedChanged otherwise.
func (t *Tiers) HoldInMemory(target checkpoint.Target, layout *checkpoint.Layout, region, metadata []byte, chunkSize int64, check *checkpoint.CopyCheck) (m *checkpoint.Manifest, data []byte, release func(), err error) {
	if layout.DataSize > t.cfg.HotBytes {
		return nil, nil, nil, budget.Wrap(fmt.Errorf("%w: the shard is larger than the hot tier", ErrNoRoom), budget.HotTier)
	}
	data, ok := t.hot.buffer(hotKey{target.Job, target.Step, target.Rank, target.Attempt}, layout.DataSize)
	if !ok {
		return nil, nil, nil, budget.Wrap(fmt.Errorf("%w: what the hot tier holds is being read, or is the only copy of newer steps kept in memory", ErrNoRoom), budget.HotTier)
	}
	layout.Pack(region, data)
	if check == nil {
		m = checkpoint.MemoryManifest(target, layout, metadata, data, chunkSize)
	} else if m, err = checkpoint.CheckedMemoryManifest(target, layout, metadata, data, check); err != nil {
		t.hot.giveBack(data)
		return nil, nil, nil, err
	}
	release, err = t.hot.insert(m, data, hotFlags{memory: true, origin: true})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: %s: %w", ErrNoRoom, keyOf(m), err)
	}
	return m, data, release, nil
}
