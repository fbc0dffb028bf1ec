package daemon

import (
	"context"
	"errors"
	"maps"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/counted"
)

// The backends whose failures ckptd status counts (DaemonStatus's
// backend_errors).
const (
	backendStore   = "store"   // the checkpoint store
	backendDataset = "dataset" // dataset sources
	backendPeers   = "peers"   // replica transfers to and from peers
)

// backendErrors counts failed operations by backend, for ckptd status and
// as ckptd_backend_errors_total{backend,op}. Unlike ckptd_errors_total
// (by what the daemon was doing: a drain, a restore), it says which
// outside system failed it.
type backendErrors struct {
	total *prometheus.CounterVec
	read  *prometheus.CounterVec // bytes read by backend

	mu     sync.Mutex
	counts map[string]uint64 // by backend
}

func newBackendErrors(reg prometheus.Registerer, backends ...string) *backendErrors {
	e := &backendErrors{
		total: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_backend_errors_total",
			Help: "Failed operations by backend (store, dataset, peers) and operation; answers such as not found are not failures.",
		}, []string{"backend", "op"}),
		read: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_backend_read_bytes_total",
			Help: "Bytes read from each backend (store, dataset): restores, verifies and dataset shards, as stored (compressed).",
		}, []string{"backend"}),
		counts: map[string]uint64{},
	}
	for _, b := range backends {
		e.counts[b] = 0 // shown as 0, not left out
	}
	reg.MustRegister(e.total, e.read)
	return e
}

// failed returns the function a decorator of backend calls for each
// failed operation.
func (e *backendErrors) failed(backend string) func(op string) {
	return func(op string) {
		e.total.WithLabelValues(backend, op).Inc()
		e.mu.Lock()
		defer e.mu.Unlock()
		e.counts[backend]++
	}
}

// Counts returns the failures so far by backend.
func (e *backendErrors) Counts() map[string]uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.counts)
}

// countStore counts b's failures, and the bytes read from it, as backend's.
func (e *backendErrors) countStore(b storage.Backend, backend string) storage.Backend {
	read := e.read.WithLabelValues(backend)
	return counted.New(b, e.failed(backend)).OnRead(func(n int64) { read.Add(float64(n)) })
}

// countOpen counts a backend that failed to open (an S3 source looks for
// its bucket) as a failed "open" of backend's.
func (e *backendErrors) countOpen(backend string, err error) error {
	if counted.Failure(err) {
		e.failed(backend)("open")
	}
	return err
}

// countPeers counts p's failed transfers as the peers'.
func (e *backendErrors) countPeers(p tiers.Peers) tiers.Peers {
	e.mu.Lock()
	e.counts[backendPeers] = 0
	e.mu.Unlock()
	return countedPeers{p: p, failed: e.failed(backendPeers)}
}

// countedPeers counts the replica transfers that fail: sending a shard,
// fetching one, and the messages that keep the peers' books (persist,
// inventory). A peer that does not hold a shard says so to FetchManifest;
// that is an answer, and it is not counted.
type countedPeers struct {
	p      tiers.Peers
	failed func(op string)
}

func (c countedPeers) count(op string, err error) error {
	if err != nil && !errors.Is(err, context.Canceled) {
		c.failed(op)
	}
	return err
}

func (c countedPeers) Replicate(ctx context.Context, m *checkpoint.Manifest, data []byte, committed, memory bool) error {
	return c.count("replicate", c.p.Replicate(ctx, m, data, committed, memory))
}

func (c countedPeers) Candidates(rank int) []string { return c.p.Candidates(rank) }

func (c countedPeers) FetchManifest(ctx context.Context, job string, step int64, rank int, attempt string, from []string) (*checkpoint.Manifest, string, error) {
	return c.p.FetchManifest(ctx, job, step, rank, attempt, from)
}

func (c countedPeers) FetchData(ctx context.Context, peer string, m *checkpoint.Manifest, dst []byte, progress func(int64)) error {
	return c.count("fetch", c.p.FetchData(ctx, peer, m, dst, progress))
}

func (c countedPeers) Persist(ctx context.Context, job string, step int64, attempt string) error {
	return c.count("persist", c.p.Persist(ctx, job, step, attempt))
}

func (c countedPeers) Inventory(ctx context.Context, job string) (map[string][]tiers.HeldShard, error) {
	held, err := c.p.Inventory(ctx, job)
	return held, c.count("inventory", err)
}
