package checkpoint

import (
	"context"
	"fmt"
	"time"
)

// Peers carries shards to and from the sidecars that keep replicas of a
// rank (ManagerConfig.Peers). The daemon's implementation speaks gRPC
// with mutual TLS; the Manager knows only this.
type Peers interface {
	// Replicate sends a drained shard (its manifest and data space) to
	// the peers that keep its rank's replicas.
	Replicate(ctx context.Context, m *Manifest, data []byte, committed bool) error
	// Fetch asks those peers for a shard of at most maxBytes; attempt ""
	// means whichever committed attempt they hold. It fails when none
	// holds it.
	Fetch(ctx context.Context, job string, step int64, rank int, attempt string, maxBytes int64) (*Manifest, []byte, error)
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
	m         *Manifest
	data      []byte
	committed bool
	queued    time.Time
}

// commitWait is how often a replica whose step is not yet committed is
// looked at again: peers serve a shard without storage only once they know
// its step committed, so a replica waits (up to replicateTimeout) for the
// commit, usually made moments later by the step's last rank, elsewhere.
const commitWait = 500 * time.Millisecond

// queueReplica hands a drained shard to replicateLoop, or drops it when
// the peers are that far behind.
func (mgr *Manager) queueReplica(r replica) {
	if r.queued.IsZero() {
		r.queued = time.Now()
	}
	select {
	case mgr.replicas <- r:
	default:
		mgr.m.failed("replicate")
		mgr.log.Warn("peers are behind; this shard is not replicated (it is in storage)", "target", r.m.Target())
	}
}

// replicateLoop sends queued shards to their peers until the Manager
// closes; NewManager starts it when there are peers.
func (mgr *Manager) replicateLoop() {
	for {
		select {
		case r := <-mgr.replicas:
			if !r.committed && !mgr.committedYet(&r) {
				continue
			}
			mgr.replicate(r)
		case <-mgr.ctx.Done():
			return
		}
	}
}

// committedYet looks up r's step in storage: true once it is committed
// (r is marked so), or once r has waited long enough (it is then sent as
// not committed); false when r went back in the queue, or was dropped
// because another attempt committed the step.
func (mgr *Manager) committedYet(r *replica) bool {
	rec, err := mgr.store(r.m.Job).readCommit(mgr.ctx, r.m.Step)
	switch {
	case err == nil && rec.Attempt == r.m.Attempt:
		r.committed = true
		return true
	case err == nil:
		return false // another run committed the step: nothing to replicate
	case time.Since(r.queued) > replicateTimeout:
		return true
	}
	if !mgr.sleep(commitWait) {
		return false
	}
	mgr.queueReplica(*r)
	return false
}

// replicate sends a drained shard to its peers; a failure is logged and
// counted, not fatal: the shard is durable in storage already.
func (mgr *Manager) replicate(r replica) {
	ctx, cancel := context.WithTimeout(mgr.ctx, replicateTimeout)
	defer cancel()
	start := time.Now()
	if err := mgr.cfg.Peers.Replicate(ctx, r.m, r.data, r.committed); err != nil {
		mgr.m.failed("replicate")
		mgr.log.Warn("replicating to peers failed; the shard stays in storage", "target", r.m.Target(), "err", err)
		return
	}
	mgr.log.Debug("replicated to peers", "target", r.m.Target(), "bytes", r.m.DataSize, "duration", time.Since(start))
}

// AcceptReplica keeps a peer's shard in the hot tier, where restores (and
// the peer's GetReplica) find it. The manifest is validated and the data
// must be its data space; chunk hashes are checked when it is served.
func (mgr *Manager) AcceptReplica(manifest, data []byte, committed bool) error {
	if !mgr.hot.enabled() {
		return fmt.Errorf("%w: this sidecar keeps no replicas (--hot-bytes is 0)", ErrArenaFull)
	}
	m, err := ParseManifest(manifest)
	if err != nil {
		return fmt.Errorf("%w: replica manifest: %w", ErrInvalid, err)
	}
	if int64(len(data)) != m.DataSize {
		return fmt.Errorf("%w: replica of %s has %d bytes of data, its manifest says %d", ErrInvalid, m.Target(), len(data), m.DataSize)
	}
	if !mgr.hot.insert(m, data, committed) {
		return fmt.Errorf("%w: no room in the hot tier for a replica of %d bytes (--hot-bytes)", ErrArenaFull, m.DataSize)
	}
	return nil
}

// Replica returns a shard the hot tier holds for a peer, and a func to
// call once it is sent.
func (mgr *Manager) Replica(job string, step int64, rank int, attempt string) (manifest, data []byte, committed bool, release func(), err error) {
	e, release := mgr.hot.getAny(job, step, rank, attempt)
	if e == nil {
		return nil, nil, false, nil, fmt.Errorf("%w: no replica of job %q step %d rank %d here", ErrStepNotFound, job, step, rank)
	}
	manifest, err = e.m.Encode()
	if err != nil {
		release()
		return nil, nil, false, nil, err
	}
	return manifest, e.data, e.committed, release, nil
}
