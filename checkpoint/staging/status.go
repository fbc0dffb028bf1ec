package staging

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/storage"
)

// State is where a rank's save stands.
type State int

// The states of a save, in order.
const (
	StateUnknown   State = iota
	StateStaging         // region leased, client copying
	StateStaged          // accepted and journaled, waiting for a drain
	StateDraining        // being written
	StateDurable         // data and manifest durable; other ranks missing
	StateCommitted       // the step's COMMIT.json exists
	StateFailed
	// Where a save of a step the persist policy keeps in memory only ends
	// (it stays draining while it is sent to the peers): in this node's
	// hot tier (no peers, or sending failed), or also on --replicas peers.
	StateHot
	StateReplicated
)

func (s State) String() string {
	return [...]string{"unknown", "staging", "staged", "draining", "durable", "committed", "failed", "hot", "replicated"}[s]
}

// final reports whether a save in st has reached where it ends: committed,
// failed, or the memory tier it was kept in.
func (st *saveStatus) final() bool {
	switch st.state {
	case StateCommitted, StateFailed, StateHot, StateReplicated:
		return true
	}
	return false
}

// inMemory reports whether s is a memory tier: weaker than durable, which
// a save kept in memory reaches when a peer's word has it persisted.
func (s State) inMemory() bool { return s == StateHot || s == StateReplicated }

type saveKey struct {
	job     string
	step    int64
	rank    int
	attempt string
}

func keyOf(t checkpoint.Target) saveKey { return saveKey{t.Job, t.Step, t.Rank, t.Attempt} }

// saveStatus tracks one rank's save for Wait. changed is closed and
// replaced on every change, so waiters never miss one.
type saveStatus struct {
	state     State
	err       error // why it failed, or the last transient drain error
	worldSize int
	updated   time.Time
	begun     time.Time // when this daemon first knew the save
	changed   chan struct{}
}

// saveStates is the registry of the saves this daemon knows, by rank,
// which Wait and Status answer from. Its lock is a leaf: taken under the
// Manager's, never the other way round.
type saveStates struct {
	mu sync.Mutex
	m  map[saveKey]*saveStatus
}

func newSaveStates() *saveStates { return &saveStates{m: map[saveKey]*saveStatus{}} }

// set records a save's state and wakes its waiters.
func (r *saveStates) set(k saveKey, s State, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.setLocked(k, s, err)
}

// setWorld is set, recording the save's world size too.
func (r *saveStates) setWorld(k saveKey, s State, err error, worldSize int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.setLocked(k, s, err).worldSize = worldSize
}

func (r *saveStates) setLocked(k saveKey, s State, err error) *saveStatus {
	st := r.m[k]
	if st == nil {
		st = &saveStatus{changed: make(chan struct{}), begun: time.Now()}
		r.m[k] = st
	}
	st.state, st.err, st.updated = s, err, time.Now()
	close(st.changed)
	st.changed = make(chan struct{})
	return st
}

// unsettled returns the state of k's save if it is known and not final.
func (r *saveStates) unsettled(k saveKey) (State, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if st := r.m[k]; st != nil && !st.final() {
		return st.state, true
	}
	return StateUnknown, false
}

// committedBy returns the attempt that committed step of job, when this
// daemon knows of one of its ranks' saves committed.
func (r *saveStates) committedBy(job string, step int64) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, st := range r.m {
		if k.job == job && k.step == step && st.state == StateCommitted {
			return k.attempt, true
		}
	}
	return "", false
}

// setUnlessFinal is set, unless the save is final already.
func (r *saveStates) setUnlessFinal(k saveKey, s State, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if st := r.m[k]; st == nil || !st.final() {
		r.setLocked(k, s, err)
	}
}

// clearStaging forgets a save that never got past staging.
func (r *saveStates) clearStaging(t checkpoint.Target) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := keyOf(t)
	if st := r.m[k]; st != nil && st.state == StateStaging {
		delete(r.m, k)
		close(st.changed)
	}
}

// statusTTL is how long finished and durable saves stay answerable from
// memory; after that Wait answers from storage (which knows a durable
// save's world size from its manifest). A durable save whose commit is
// being retried refreshes its status at every try, so it stays.
const statusTTL = 10 * time.Minute

// gc drops settled statuses past their TTL.
func (r *saveStates) gc(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, st := range r.m {
		if (st.final() || st.state == StateDurable) && now.Sub(st.updated) > statusTTL {
			delete(r.m, k)
		}
	}
}

// each calls fn with every known save, under the registry's lock.
func (r *saveStates) each(fn func(k saveKey, st *saveStatus)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, st := range r.m {
		fn(k, st)
	}
}

// WaitResult is the outcome of Wait.
type WaitResult struct {
	State State
	Err   error // the failure, or the last transient error while retrying
	final bool  // State is where the save ends (see saveStatus.final)
}

// Wait blocks until the rank's save of step by attempt is committed or
// has failed, or ctx ends; then it returns the current state and ctx's
// error. An empty attempt means whichever attempt this daemon knows of. A
// save this daemon does not know of is answered from storage.
//
// Waiting on a durable save may write COMMIT.json: the drain that wrote
// the last rank tries to commit, but if that attempt failed (a storage
// error, a daemon that died just then, on whichever node it ran), nobody
// else would ever commit the step, and every rank would wait forever.
// Store.TryCommit is idempotent and decides from storage, so a waiter retrying
// it is safe.
func (mgr *Manager) Wait(ctx context.Context, job string, step int64, rank int, attempt string) (WaitResult, error) {
	k := saveKey{mgr.job(job), step, rank, attempt}
	poll, durable := 50*time.Millisecond, false
	for {
		res, changed, known := mgr.saves.status(&k)
		if known && res.final {
			return res, nil
		}
		if !known {
			var err error
			if res, err = mgr.stateFromStorage(ctx, k); err != nil {
				return res, err
			}
		}
		switch res.State {
		case StateCommitted, StateFailed:
			return res, nil
		case StateDurable:
			// Other ranks commit the step, maybe on other nodes: poll storage,
			// committing ourselves if the last manifest appeared without one.
			// A commit here (this daemon's drain of the step's last rank)
			// still wakes the waiter at once, through changed.
			if ws := mgr.saves.worldSize(k); ws > 0 {
				if done, _ := mgr.tryCommit(ctx, checkpoint.Target{Job: k.job, Step: k.step, Rank: k.rank, WorldSize: ws, Attempt: k.attempt}); done {
					continue // the outcome is recorded: committed, or failed
				}
			}
			if !durable { // storage is polled from now on, backing off from 50 ms
				durable, poll = true, 50*time.Millisecond
			}
		}
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-changed:
		case <-time.After(poll):
			poll = min(2*poll, time.Second)
		}
	}
}

// status returns what this daemon knows of the save k names. With no
// attempt in k, it picks the most recently updated save of that rank and
// step, and fills in k's attempt.
func (r *saveStates) status(k *saveKey) (WaitResult, chan struct{}, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.m[*k]
	if st == nil && k.attempt == "" {
		for sk, s := range r.m {
			if sk.job == k.job && sk.step == k.step && sk.rank == k.rank && (st == nil || s.updated.After(st.updated)) {
				st, k.attempt = s, sk.attempt
			}
		}
	}
	if st == nil {
		return WaitResult{}, nil, false
	}
	return WaitResult{State: st.state, Err: st.err, final: st.final()}, st.changed, true
}

// Status returns a save's current state without waiting: from memory when
// this daemon knows the save, else from storage.
func (mgr *Manager) Status(ctx context.Context, job string, step int64, rank int, attempt string) (WaitResult, error) {
	k := saveKey{mgr.job(job), step, rank, attempt}
	if res, _, known := mgr.saves.status(&k); known {
		return res, nil
	}
	return mgr.stateFromStorage(ctx, k)
}

// stateFromStorage answers for a save not in memory: committed when the
// step's commit record names its attempt (or k names none), failed when
// it names another, durable when the attempt's manifest of the rank is
// there.
func (mgr *Manager) stateFromStorage(ctx context.Context, k saveKey) (WaitResult, error) {
	store, err := mgr.jobStore(k.job)
	if err != nil {
		return WaitResult{}, err
	}
	rec, err := store.ReadCommit(ctx, k.step)
	switch {
	case err == nil && (k.attempt == "" || rec.Attempt == k.attempt):
		return WaitResult{State: StateCommitted}, nil
	case err == nil:
		return WaitResult{State: StateFailed, Err: &checkpoint.CommittedError{Job: k.job, Step: k.step, Attempt: rec.Attempt}}, nil
	case !errors.Is(err, storage.ErrNotFound):
		return WaitResult{}, err
	}
	notFound := fmt.Errorf("%w: no save of job %q step %d rank %d is known to this daemon or in %s",
		checkpoint.ErrStepNotFound, k.job, k.step, k.rank, mgr.b.Location())
	if k.attempt == "" {
		return WaitResult{}, notFound
	}
	m, err := store.RankManifest(ctx, checkpoint.Target{Job: k.job, Step: k.step, Rank: k.rank, Attempt: k.attempt})
	if err != nil {
		if !errors.Is(err, storage.ErrNotFound) { // corrupt, or storage down: not "unknown"
			return WaitResult{}, err
		}
		return WaitResult{}, notFound
	}
	mgr.saves.setWorld(k, StateDurable, nil, m.WorldSize)
	return WaitResult{State: StateDurable}, nil
}

func (r *saveStates) worldSize(k saveKey) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if st := r.m[k]; st != nil {
		return st.worldSize
	}
	return 0
}

// markDone records a save's final state unless it has one already, or the
// state is a memory tier and the save is durable meanwhile: a save is
// reported at the strongest tier it reached.
func (mgr *Manager) markDone(k saveKey, s State, err error) {
	if mgr.saves.settle(k, s, err) && s != StateFailed {
		mgr.m.Tiers.WithLabelValues(s.String()).Inc()
	}
	if (s == StateCommitted || s == StateFailed) && mgr.cfg.Writer.Incremental {
		// An incremental save's step is final: its manifest (or nothing)
		// now keeps what it references.
		ctx, cancel := context.WithTimeout(mgr.ctx, unpinTimeout)
		defer cancel()
		mgr.w.Unpin(ctx, checkpoint.Target{Job: k.job, Step: k.step, Rank: k.rank, Attempt: k.attempt})
	}
}

// unpinTimeout bounds the removal of a pin, which a waiter waits for: a pin
// left behind costs only storage, until prune's grace.
const unpinTimeout = 5 * time.Second

// settle is markDone's change: it reports whether it made one.
func (r *saveStates) settle(k saveKey, s State, err error) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.m[k]
	if st == nil || st.final() || s.inMemory() && st.state == StateDurable {
		return false
	}
	r.setLocked(k, s, err)
	return true
}
