package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/metrics"
	"github.com/ckptd/ckptd/storage"
)

// ManagerConfig configures the daemon's checkpoint core.
type ManagerConfig struct {
	// DefaultJob is used when a request names no job.
	DefaultJob string
	// StagingWait bounds how long BeginSave and BeginRestore wait for arena
	// space before failing with arena.ErrFull (default 30s).
	StagingWait time.Duration
	// LeaseTimeout reclaims save leases never committed and restore leases
	// never released, e.g. of a trainer that died (default 30m).
	LeaseTimeout time.Duration
	// Drains is how many shards drain at once (default 2); chunk-level
	// parallelism is WriterOptions.Workers.
	Drains  int
	Writer  WriterOptions
	Read    ReadOptions
	Metrics *metrics.Checkpoint
	Logger  *slog.Logger
	// DrainDelay delays every drain; tests use it to crash the daemon
	// while a save is accepted but not yet durable.
	DrainDelay time.Duration
}

func (c *ManagerConfig) setDefaults() {
	if c.StagingWait <= 0 {
		c.StagingWait = 30 * time.Second
	}
	if c.LeaseTimeout <= 0 {
		c.LeaseTimeout = 30 * time.Minute
	}
	if c.Drains <= 0 {
		c.Drains = 2
	}
	if c.Metrics == nil {
		c.Metrics = metrics.NewCheckpoint(nil)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Manager is the daemon's checkpoint core: it hands out arena leases,
// journals accepted saves, drains them to storage, commits steps and
// restores them into the arena. It knows nothing of gRPC.
type Manager struct {
	cfg   ManagerConfig
	arena *arena.Arena
	b     storage.Backend
	w     *Writer
	log   *slog.Logger
	m     *metrics.Checkpoint

	mu      sync.Mutex
	leases  map[string]*lease
	saves   map[saveKey]*saveStatus
	queue   []*lease
	wake    chan struct{} // signalled when queue grows or on close
	closing bool
	active  int // drains in progress

	seq    atomic.Uint64
	ctx    context.Context // cancelled to abandon drains at shutdown
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type leaseKind int

const (
	saveLease leaseKind = iota
	restoreLease
)

// lease is a region of the arena held by a save or a restore.
type lease struct {
	id        string
	kind      leaseKind
	region    arena.Region // Length 0: nothing allocated
	size      int64        // bytes of the region the lease covers
	target    Target
	layout    *Layout
	metadata  []byte
	committed bool
	begun     time.Time
	expires   time.Time
}

// LeaseInfo is what a client needs to use a region.
type LeaseInfo struct {
	ID     string
	Offset int64
	Length int64
}

func (l *lease) info() LeaseInfo {
	return LeaseInfo{ID: l.id, Offset: l.region.Offset, Length: l.size}
}

// NewManager starts the checkpoint core on an open arena: it re-queues the
// saves journaled by an earlier process (nothing acknowledged is lost) and
// starts the drain workers. Close stops them.
func NewManager(a *arena.Arena, b storage.Backend, cfg ManagerConfig) (*Manager, error) {
	cfg.setDefaults()
	if err := ValidateName("job", cfg.DefaultJob); err != nil {
		return nil, fmt.Errorf("default job: %w", err)
	}
	w, err := NewWriter(b, cfg.Writer)
	if err != nil {
		return nil, err
	}
	mgr := &Manager{
		cfg: cfg, arena: a, b: b, w: w, log: cfg.Logger, m: cfg.Metrics,
		leases: map[string]*lease{}, saves: map[saveKey]*saveStatus{},
		wake: make(chan struct{}, 1),
	}
	mgr.ctx, mgr.cancel = context.WithCancel(context.Background())
	if err := mgr.recover(); err != nil {
		return nil, err
	}
	for range cfg.Drains {
		mgr.wg.Go(mgr.drainLoop)
	}
	mgr.wg.Go(mgr.reapLoop)
	return mgr, nil
}

// Arena returns the staging arena.
func (mgr *Manager) Arena() *arena.Arena { return mgr.arena }

// DefaultJob returns the job used when a request names none.
func (mgr *Manager) DefaultJob() string { return mgr.cfg.DefaultJob }

// Backend returns the storage the manager drains to.
func (mgr *Manager) Backend() storage.Backend { return mgr.b }

func (mgr *Manager) job(j string) string {
	if j == "" {
		return mgr.cfg.DefaultJob
	}
	return j
}

func (mgr *Manager) newLeaseID() string {
	return fmt.Sprintf("%016x-%06x", time.Now().UnixNano(), mgr.seq.Add(1)&0xffffff)
}

// ErrClosing is returned for new work while the daemon shuts down.
var ErrClosing = errors.New("ckptd is shutting down")

// Close stops accepting work and waits, until ctx is done, for queued
// saves to become durable. Saves still queued or draining when ctx ends
// stay journaled in the arena and drain when a new Manager opens it.
// Close reports how many saves were left journaled.
func (mgr *Manager) Close(ctx context.Context) int {
	mgr.mu.Lock()
	mgr.closing = true
	mgr.mu.Unlock()
	mgr.signal()
	done := make(chan struct{})
	go func() { mgr.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		mgr.cancel()
		<-done
	}
	mgr.cancel()
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	n := 0
	for _, l := range mgr.leases {
		if l.kind == saveLease && l.committed {
			n++
		}
	}
	return n
}

func (mgr *Manager) signal() {
	select {
	case mgr.wake <- struct{}{}:
	default:
	}
}

// reapLoop reclaims expired leases once a second.
func (mgr *Manager) reapLoop() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-mgr.ctx.Done():
			return
		case now := <-t.C:
			mgr.reap(now)
			mgr.mu.Lock()
			closing := mgr.closing
			mgr.mu.Unlock()
			if closing {
				return
			}
		}
	}
}

func (mgr *Manager) reap(now time.Time) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	for id, l := range mgr.leases {
		if l.committed || now.Before(l.expires) {
			continue
		}
		mgr.log.Warn("reclaiming expired lease", "lease", id, "kind", l.kind, "bytes", l.region.Length)
		mgr.dropLease(l)
	}
	mgr.gcStatuses(now)
}

// dropLease frees an uncommitted lease's region. Call with mu.
func (mgr *Manager) dropLease(l *lease) {
	delete(mgr.leases, l.id)
	if l.kind == saveLease {
		mgr.clearStaging(l.target)
	}
	mgr.freeRegion(l.region)
}

func (mgr *Manager) freeRegion(r arena.Region) {
	if r.Length == 0 {
		return
	}
	if err := mgr.arena.Free(r); err != nil {
		mgr.log.Error("arena free failed", "err", err)
	}
	mgr.m.ArenaUsed.Set(float64(mgr.arena.Used()))
}

func (mgr *Manager) alloc(ctx context.Context, n int64) (arena.Region, error) {
	if n == 0 {
		return arena.Region{}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, mgr.cfg.StagingWait)
	defer cancel()
	r, err := mgr.arena.Alloc(ctx, n)
	if errors.Is(err, arena.ErrTooLarge) {
		err = fmt.Errorf("%w; the shard must fit the staging arena: restart the daemon with --staging-bytes of at least %d", err, n)
	}
	if err != nil {
		mgr.m.Error("alloc")
		return r, err
	}
	mgr.m.ArenaUsed.Set(float64(mgr.arena.Used()))
	return r, nil
}
