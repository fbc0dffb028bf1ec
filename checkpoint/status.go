package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"time"

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
)

func (s State) String() string {
	return [...]string{"unknown", "staging", "staged", "draining", "durable", "committed", "failed"}[s]
}

type saveKey struct {
	job  string
	step int64
	rank int
}

func keyOf(t Target) saveKey { return saveKey{t.Job, t.Step, t.Rank} }

// saveStatus tracks one rank's save for Wait. changed is closed and
// replaced on every change, so waiters never miss one.
type saveStatus struct {
	state     State
	err       error // why it failed, or the last transient drain error
	worldSize int
	updated   time.Time
	changed   chan struct{}
}

// setState records a save's state and wakes its waiters. Call with mu.
func (mgr *Manager) setState(k saveKey, s State, err error) {
	st := mgr.saves[k]
	if st == nil {
		st = &saveStatus{changed: make(chan struct{})}
		mgr.saves[k] = st
	}
	st.state, st.err, st.updated = s, err, time.Now()
	close(st.changed)
	st.changed = make(chan struct{})
}

// clearStaging forgets a save that never got past staging. Call with mu.
func (mgr *Manager) clearStaging(t Target) {
	k := keyOf(t)
	if st := mgr.saves[k]; st != nil && st.state == StateStaging {
		delete(mgr.saves, k)
		close(st.changed)
	}
}

// statusTTL is how long finished saves stay answerable from memory; after
// that Wait answers from storage.
const statusTTL = 10 * time.Minute

// gcStatuses drops finished statuses past their TTL. Call with mu.
func (mgr *Manager) gcStatuses(now time.Time) {
	for k, st := range mgr.saves {
		if (st.state == StateCommitted || st.state == StateFailed) && now.Sub(st.updated) > statusTTL {
			delete(mgr.saves, k)
		}
	}
}

// WaitResult is the outcome of Wait.
type WaitResult struct {
	State State
	Err   error // the failure, or the last transient error while retrying
}

// Wait blocks until the rank's save of step is committed or has failed, or
// ctx ends; then it returns the current state and ctx's error. A save this
// daemon does not know of is answered from storage.
func (mgr *Manager) Wait(ctx context.Context, job string, step int64, rank int) (WaitResult, error) {
	job = mgr.job(job)
	k := saveKey{job, step, rank}
	store := &Store{B: mgr.b, Job: job}
	poll := 50 * time.Millisecond
	for {
		mgr.mu.Lock()
		st := mgr.saves[k]
		var res WaitResult
		var changed chan struct{}
		if st != nil {
			res, changed = WaitResult{st.state, st.err}, st.changed
		}
		mgr.mu.Unlock()
		if st == nil {
			var err error
			if res, err = mgr.stateFromStorage(ctx, store, k); err != nil {
				return res, err
			}
		}
		switch res.State {
		case StateCommitted, StateFailed:
			return res, nil
		case StateDurable:
			// Other ranks commit the step, maybe on other nodes: poll storage,
			// committing ourselves if the last manifest appeared without one.
			if ok, won, err := TryCommit(ctx, mgr.b, job, step, mgr.worldSize(k)); err == nil && ok {
				mgr.logCommit(job, step, won)
				mgr.markCommitted(k)
				return WaitResult{State: StateCommitted}, nil
			}
			changed = nil
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

// Status returns a save's current state without waiting: from memory when
// this daemon knows the save, else from storage.
func (mgr *Manager) Status(ctx context.Context, job string, step int64, rank int) (WaitResult, error) {
	job = mgr.job(job)
	k := saveKey{job, step, rank}
	mgr.mu.Lock()
	st := mgr.saves[k]
	var res WaitResult
	if st != nil {
		res = WaitResult{st.state, st.err}
	}
	mgr.mu.Unlock()
	if st != nil {
		return res, nil
	}
	return mgr.stateFromStorage(ctx, &Store{B: mgr.b, Job: job}, k)
}

// stateFromStorage answers Wait for a save not in memory.
func (mgr *Manager) stateFromStorage(ctx context.Context, store *Store, k saveKey) (WaitResult, error) {
	if ok, err := store.Committed(ctx, k.step); err != nil || ok {
		return WaitResult{State: StateCommitted}, err
	}
	m, err := readManifest(ctx, mgr.b, manifestName(k.job, k.step, k.rank))
	if err != nil {
		if !errors.Is(err, storage.ErrNotFound) { // corrupt, or storage down: not "unknown"
			return WaitResult{}, err
		}
		return WaitResult{}, fmt.Errorf("%w: no save of job %q step %d rank %d is known to this daemon or in %s",
			ErrStepNotFound, k.job, k.step, k.rank, mgr.b.Location())
	}
	mgr.mu.Lock()
	mgr.setState(k, StateDurable, nil)
	mgr.saves[k].worldSize = m.WorldSize
	mgr.mu.Unlock()
	return WaitResult{State: StateDurable}, nil
}

func (mgr *Manager) worldSize(k saveKey) int {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if st := mgr.saves[k]; st != nil {
		return st.worldSize
	}
	return 0
}

func (mgr *Manager) markCommitted(k saveKey) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	if st := mgr.saves[k]; st != nil && st.state != StateCommitted {
		mgr.setState(k, StateCommitted, nil)
	}
}
