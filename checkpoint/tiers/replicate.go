package tiers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
)

// Peers carries shards to and from the sidecars that keep replicas of a
// rank (Config.Peers). The daemon's implementation speaks gRPC with
// mutual TLS; the tiers know only this.
type Peers interface {
	// Replicate sends a shard (its manifest and data space) to the peers
	// that keep its rank's replicas: a drained one (committed when its
	// step is), or one of a step kept in memory only (memory).
	Replicate(ctx context.Context, m *checkpoint.Manifest, data []byte, committed, memory bool) error
	// FetchManifest asks the peers in from (those peers when from is
	// empty) for a shard's manifest; attempt "" means whichever committed
	// attempt they hold. It returns the manifest and the peer that has
	// the shard, or fails when none holds it.
	FetchManifest(ctx context.Context, job string, step int64, rank int, attempt string, from []string) (*checkpoint.Manifest, string, error)
	// FetchData reads the data space of the shard m describes from peer
	// into dst (m.DataSize bytes), calling progress with the bytes read so
	// far as they arrive. It fails if the peer's copy is no longer m's.
	FetchData(ctx context.Context, peer string, m *checkpoint.Manifest, dst []byte, progress func(int64)) error
	// Persist tells every peer that this sidecar persisted step of job
	// by attempt (see policy.go).
	Persist(ctx context.Context, job string, step int64, attempt string) error
	// Inventory asks every peer which shards of job it holds, by peer
	// address. Peers that do not answer within a short deadline are left
	// out, and named in the error.
	Inventory(ctx context.Context, job string) (map[string][]HeldShard, error)
	// Candidates are the peers that may keep rank's replicas, in the order
	// FetchManifest asks them when given none.
	Candidates(rank int) []string
}

// replicateTimeout bounds sending one shard to its peers: a slow or dead
// peer is given up on after it, and counted.
const replicateTimeout = time.Minute

// replicaQueue bounds the shards waiting to be sent to peers. They are the
// hot tier's copies (no more memory), sent one at a time by replicateLoop,
// after their drain ended: replication never holds the arena or the
// trainer. A shard that finds the queue full is not replicated (counted).
const replicaQueue = 8

// replica is a drained shard to send to its peers.
type replica struct {
	m         *checkpoint.Manifest
	data      []byte
	committed bool
	memory    bool   // a step kept in memory only: no commit to wait for
	release   func() // unpins the hot-tier entry data belongs to, once sent or dropped
	// done, for a step kept in memory only, learns whether the shard
	// reached its peers (nil) or not (why).
	done   func(error)
	queued time.Time
}

// Replicate queues a drained shard for its peers: data, m's data space,
// pinned in the hot tier until release; committed when its step is
// (Replicate waits for the commit otherwise).
func (t *Tiers) Replicate(m *checkpoint.Manifest, data []byte, committed bool, release func()) {
	t.queueReplica(replica{m: m, data: data, committed: committed, release: release})
}

// ReplicateMemoryOnly queues a shard of a step kept in memory only
// (HoldInMemory) for its peers; done learns whether it reached them.
func (t *Tiers) ReplicateMemoryOnly(m *checkpoint.Manifest, data []byte, release func(), done func(error)) {
	t.queueReplica(replica{m: m, data: data, memory: true, release: release, done: done})
}

// commitWait is how often a replica whose step is not yet committed is
// looked at again: peers serve a shard without storage only once they know
// its step committed, so a replica waits (up to replicateTimeout) for the
// commit, usually made moments later by the step's last rank, elsewhere.
const commitWait = 500 * time.Millisecond

// queueReplica hands a drained shard to replicateLoop, or drops it when
// the peers are that far behind.
func (t *Tiers) queueReplica(r replica) {
	if r.queued.IsZero() {
		r.queued = time.Now()
	}
	select {
	case t.replicas <- r:
	default:
		r.release()
		t.cfg.Failed("replicate")
		if r.memory {
			t.log.Warn("peers are behind; this shard is not replicated: it is held in this node's memory only", "target", r.m.Target())
			r.done(errors.New("not replicated: the peers are behind"))
			return
		}
		t.log.Warn("peers are behind; this shard is not replicated (it is in storage)", "target", r.m.Target())
	}
}

// replicateLoop sends queued shards to their peers until the Manager
// close; New starts it when there are peers.
func (t *Tiers) replicateLoop() {
	for {
		select {
		case r := <-t.replicas:
			if !r.committed && !r.memory && !t.committedYet(&r) {
				continue
			}
			t.replicate(r)
		case <-t.ctx.Done():
			return
		}
	}
}

// committedYet looks up r's step in storage: true once it is committed
// (r is marked so), or once r has waited long enough (it is then sent as
// not committed); false when r went back in the queue, or was dropped
// because another attempt committed the step.
func (t *Tiers) committedYet(r *replica) bool {
	var rec *checkpoint.CommitRecord
	store, err := checkpoint.NewStore(t.cfg.Backend, r.m.Job)
	if err == nil {
		rec, err = store.WithLogger(t.log).ReadCommit(t.ctx, r.m.Step)
	}
	switch {
	case err == nil && rec.Attempt == r.m.Attempt:
		r.committed = true
		return true
	case err == nil:
		r.release()
		return false // another run committed the step: nothing to replicate
	case time.Since(r.queued) > replicateTimeout:
		return true
	}
	if !t.sleep(commitWait) {
		return false
	}
	t.queueReplica(*r)
	return false
}

// sleep waits d unless the tiers are closing.
func (t *Tiers) sleep(d time.Duration) bool {
	select {
	case <-time.After(d):
		return true
	case <-t.ctx.Done():
		return false
	}
}

// replicate sends a shard to its peers. A failure is logged and counted,
// not fatal: a drained shard is durable in storage already, and one of a
// step kept in memory only stays in this node's memory (its save's state
// says so).
func (t *Tiers) replicate(r replica) {
	defer r.release()
	ctx, cancel := context.WithTimeout(t.ctx, replicateTimeout)
	defer cancel()
	start := time.Now()
	err := t.cfg.Peers.Replicate(ctx, r.m, r.data, r.committed, r.memory)
	if err != nil {
		t.cfg.Failed("replicate")
		t.log.Warn("replicating to peers failed", "target", r.m.Target(), "memory_only", r.memory, "err", err)
	} else {
		t.log.Debug("replicated to peers", "target", r.m.Target(), "bytes", r.m.DataSize, "duration", time.Since(start))
	}
	if !r.memory {
		return
	}
	if err != nil {
		r.done(fmt.Errorf("not replicated: %w", err))
		return
	}
	r.done(nil)
}

// AcceptReplica keeps a peer's shard of want in the hot tier, where
// restores (and the peer's GetReplica) find it. The manifest is validated
// and must describe want, and the data must be its data space, in a
// buffer ReplicaBuffer handed out (given back when the replica is
// refused); chunk hashes are checked when it is served. Whether the step
// is committed is never taken from the peer: the shard is served as
// committed once a commit record this sidecar read pins it. A replica
// never replaces a shard held under the same key; the same bytes again
// are taken as kept.
func (t *Tiers) AcceptReplica(want checkpoint.Target, manifest, data []byte, memory bool) error {
	if !t.hot.enabled() {
		t.hot.giveBack(data)
		return budget.Wrap(fmt.Errorf("%w: this sidecar keeps no replicas (its hot tier is off)", ErrNoRoom), budget.HotTier)
	}
	m, err := checkpoint.ParseManifest(manifest)
	if err != nil {
		t.hot.giveBack(data)
		return fmt.Errorf("%w: replica manifest: %w", checkpoint.ErrInvalid, err)
	}
	if m.Target() != want {
		t.hot.giveBack(data)
		return fmt.Errorf("%w: a replica announced as %s has the manifest of %s", checkpoint.ErrInvalid, want, m.Target())
	}
	if int64(len(data)) != m.DataSize {
		t.hot.giveBack(data)
		return fmt.Errorf("%w: replica of %s has %d bytes of data, its manifest says %d", checkpoint.ErrInvalid, m.Target(), len(data), m.DataSize)
	}
	release, err := t.hot.insert(m, data, hotFlags{memory: memory})
	release()
	if err != nil {
		return fmt.Errorf("%w: a replica of %s is refused: %w", checkpoint.ErrExists, keyOf(m), err)
	}
	return nil
}

// Holds reports whether the hot tier holds the shard t names.
func (t *Tiers) Holds(target checkpoint.Target) bool {
	return t.hot.holds(hotKey{target.Job, target.Step, target.Rank, target.Attempt})
}

// ReplicaBuffer returns n bytes to receive a peer's replica of want into,
// charged to the hot tier from now on: a spare of the hot tier when one
// fits (see hotTier), room made for it as an insert of want would (so
// that a replica of a job's newer step takes the place of its older
// ones). Give it to AcceptReplica, or back with ReturnBuffer.
func (t *Tiers) ReplicaBuffer(want checkpoint.Target, n int64) ([]byte, error) {
	b, ok := t.hot.buffer(hotKey{want.Job, want.Step, want.Rank, want.Attempt}, n)
	if !ok {
		return nil, budget.Wrap(fmt.Errorf("%w for a replica of %d bytes", ErrNoRoom, n), budget.HotTier)
	}
	return b, nil
}

// ReturnBuffer gives back a buffer ReplicaBuffer handed out, unused.
func (t *Tiers) ReturnBuffer(b []byte) { t.hot.giveBack(b) }

// Replica returns a shard the hot tier holds for a peer, and a func to
// call once it is sent.
func (t *Tiers) Replica(job string, step int64, rank int, attempt string) (manifest, data []byte, committed bool, release func(), err error) {
	e, release := t.hot.getAny(job, step, rank, attempt)
	if e == nil {
		return nil, nil, false, nil, fmt.Errorf("%w: no replica of job %q step %d rank %d here", checkpoint.ErrStepNotFound, job, step, rank)
	}
	manifest, err = e.m.Encode()
	if err != nil {
		release()
		return nil, nil, false, nil, err
	}
	return manifest, e.data, e.committed, release, nil
}
