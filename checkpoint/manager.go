package checkpoint

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// ManagerConfig configures the daemon's checkpoint core.
type ManagerConfig struct {
	// DefaultJob is used when a request names no job.
	DefaultJob string
	// StagingWait bounds how long BeginSave and BeginRestore wait for arena
	// space before failing with ErrArenaFull (default 30s).
	StagingWait time.Duration
	// LeaseTimeout ends save leases never committed and restore leases
	// never released (default 30m). A lease whose owner is gone ends at
	// once; see Owner.
	LeaseTimeout time.Duration
	// TableBudget bounds the memory held by the tensor tables and metadata
	// of open saves (leased, staged or draining), so that requests with
	// huge tables cannot exhaust the daemon (default 256 MiB).
	TableBudget int64
	// ReuseFence is how long, after starting on a crashed daemon's arena
	// (kept for its journaled saves), no new region is handed out
	// (default 10s): a trainer of the dead daemon may still be copying
	// into a region it had leased but not committed, which this daemon
	// sees as free. BeginSave and BeginRestore wait it out.
	ReuseFence time.Duration
	// Drains is how many shards drain at once (default 2); chunk-level
	// parallelism is WriterOptions.Workers.
	Drains  int
	Writer  WriterOptions
	Read    ReadOptions
	Metrics *Metrics
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
	if c.TableBudget <= 0 {
		c.TableBudget = 256 << 20
	}
	if c.ReuseFence <= 0 {
		c.ReuseFence = 10 * time.Second
	}
	if c.Drains <= 0 {
		c.Drains = 2
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Owner is who holds a lease: one client connection. Done is closed when
// the connection goes away; what the owner still holds then (save leases
// not yet committed, restore regions) is released at once, so a trainer
// that dies between BeginSave and CommitSave does not pin arena space
// until LeaseTimeout. The zero Owner is an in-process caller, never
// released that way.
type Owner struct {
	ID   string
	Done <-chan struct{}
}

func (o Owner) gone() bool {
	if o.Done == nil {
		return false
	}
	select {
	case <-o.Done:
		return true
	default:
		return false
	}
}

// Manager is the daemon's checkpoint core: it hands out arena leases,
// journals accepted saves, drains them to storage, commits steps and
// restores them into the arena. It knows nothing of gRPC.
type Manager struct {
	cfg   ManagerConfig
	arena Arena
	b     storage.Backend
	w     *Writer
	log   *slog.Logger
	m     *Metrics

	mu      sync.Mutex
	leases  map[string]*lease
	saves   map[saveKey]*saveStatus
	queue   []*lease
	wake    chan struct{} // signalled when queue grows or on close
	closing bool
	active  int // drains in progress
	tables  int64
	// held are the regions of expired leases whose owners live: a writer
	// may still be copying into them, so they are not reused until the
	// owner goes.
	held     map[string][]Region
	watching map[string]bool // owners with a watchOwner goroutine
	fence    time.Time       // no new regions before this (see ReuseFence)

	ctx      context.Context // cancelled to abandon drains at shutdown
	cancel   context.CancelFunc
	wg       sync.WaitGroup // drains and the reaper
	watchers sync.WaitGroup // watchOwner goroutines, stopped by cancel
}

type leaseKind int

const (
	saveLease leaseKind = iota
	restoreLease
)

func (k leaseKind) String() string { return [...]string{"save", "restore"}[k] }

// lease is a region of the arena held by a save or a restore.
type lease struct {
	id        string
	kind      leaseKind
	owner     string
	region    Region // Length 0: nothing allocated
	size      int64  // bytes of the region the lease covers
	target    Target
	layout    *Layout
	metadata  []byte
	committed bool
	cost      int64 // charged to TableBudget
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
func NewManager(a Arena, b storage.Backend, cfg ManagerConfig) (*Manager, error) {
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
		held: map[string][]Region{}, watching: map[string]bool{},
		wake: make(chan struct{}, 1),
	}
	mgr.ctx, mgr.cancel = context.WithCancel(context.Background())
	if a.Reused() {
		mgr.fence = time.Now().Add(cfg.ReuseFence)
		mgr.log.Info("arena kept from a crashed daemon: new regions wait until its clients' copies have ended", "for", cfg.ReuseFence)
	}
	if err := mgr.recover(); err != nil {
		return nil, err
	}
	for range cfg.Drains {
		mgr.wg.Go(mgr.drainLoop)
	}
	mgr.wg.Go(mgr.reapLoop)
	return mgr, nil
}

// DefaultJob returns the job used when a request names none.
func (mgr *Manager) DefaultJob() string { return mgr.cfg.DefaultJob }

// Backend returns the storage the manager drains to.
func (mgr *Manager) Backend() storage.Backend { return mgr.b }

// store is the Store of a job whose name a request's validation has
// checked already.
func (mgr *Manager) store(job string) *Store {
	return &Store{B: mgr.b, Job: job, Log: mgr.log}
}

// jobStore is the Store of the job a request names (the default job when
// it names none), once its name is checked.
func (mgr *Manager) jobStore(job string) (*Store, error) {
	job = mgr.job(job)
	if err := ValidateName("job", job); err != nil {
		return nil, err
	}
	return mgr.store(job), nil
}

func (mgr *Manager) job(j string) string {
	if j == "" {
		return mgr.cfg.DefaultJob
	}
	return j
}

// newLeaseID returns 128 random bits: a lease id is a capability, so it
// must not be guessable from another client's.
func newLeaseID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // never fails (crypto/rand panics rather)
	return hex.EncodeToString(b)
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
	mgr.watchers.Wait()
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

// addLease records a new lease for owner. A lease for an owner already
// gone is dropped at once: its connection closed while the request was
// being served, after the owner's leases were released. Call with mu.
func (mgr *Manager) addLease(l *lease, o Owner) error {
	l.owner = o.ID
	mgr.leases[l.id] = l
	if o.gone() {
		mgr.dropLease(l)
		return fmt.Errorf("%w: the client went away", context.Canceled)
	}
	if o.Done != nil && !mgr.watching[o.ID] {
		mgr.watching[o.ID] = true
		mgr.watchers.Go(func() { mgr.watchOwner(o) })
	}
	return nil
}

// lookup returns owner's open lease id of kind, or nil. Another owner's
// lease is as unknown as one never granted.
func (mgr *Manager) lookup(id string, o Owner) *lease {
	l := mgr.leases[id]
	if l == nil || l.owner != o.ID {
		return nil
	}
	return l
}

// watchOwner releases what o holds once it goes away.
func (mgr *Manager) watchOwner(o Owner) {
	select {
	case <-o.Done:
	case <-mgr.ctx.Done():
		return
	}
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	delete(mgr.watching, o.ID)
	n := 0
	for _, l := range mgr.leases {
		if l.owner == o.ID && !l.committed {
			mgr.dropLease(l)
			n++
		}
	}
	for _, r := range mgr.held[o.ID] {
		mgr.freeRegion(r)
		n++
	}
	delete(mgr.held, o.ID)
	if n > 0 {
		mgr.m.LeasesReleased.WithLabelValues("disconnect").Add(float64(n))
		mgr.log.Info("client went away; released what it held", "leases", n)
	}
}

// reapLoop ends expired leases once a second.
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

// reap ends leases past their timeout. The lease id stops working at
// once; its region is freed too unless its owner is connected, since a
// live client may still be copying into it: that region is reused only
// once the owner goes, so a slow writer can never scribble over a region
// handed to someone else.
func (mgr *Manager) reap(now time.Time) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	for id, l := range mgr.leases {
		if l.committed || now.Before(l.expires) {
			continue
		}
		live := l.owner != "" && mgr.watching[l.owner]
		mgr.log.Warn("lease expired", "lease", id, "kind", l.kind, "bytes", l.region.Length,
			"region_held_until_client_disconnects", live)
		mgr.m.LeasesReleased.WithLabelValues("expired").Inc()
		if live {
			mgr.held[l.owner] = append(mgr.held[l.owner], l.region)
			l.region = Region{}
		}
		mgr.dropLease(l)
	}
	mgr.gcStatuses(now)
}

// dropLease ends an uncommitted lease and frees its region. Call with mu.
func (mgr *Manager) dropLease(l *lease) {
	delete(mgr.leases, l.id)
	if l.kind == saveLease {
		mgr.clearStaging(l.target)
	}
	mgr.uncharge(l)
	mgr.freeRegion(l.region)
}

// charge books n bytes of TableBudget for l. Call with mu.
func (mgr *Manager) charge(l *lease, n int64) error {
	if mgr.tables+n > mgr.cfg.TableBudget {
		return fmt.Errorf("%w: the tensor tables and metadata of open saves would hold %d bytes, more than --tensor-table-bytes (%d); "+
			"wait for saves to drain, save fewer tensors at once, or raise the budget", ErrOverBudget, mgr.tables+n, mgr.cfg.TableBudget)
	}
	mgr.tables += n
	l.cost += n
	mgr.m.TableBytes.Set(float64(mgr.tables))
	return nil
}

func (mgr *Manager) uncharge(l *lease) {
	mgr.tables -= l.cost
	l.cost = 0
	mgr.m.TableBytes.Set(float64(mgr.tables))
}

func (mgr *Manager) freeRegion(r Region) {
	if r.Length == 0 {
		return
	}
	if err := mgr.arena.Free(r); err != nil {
		mgr.log.Error("arena free failed", "err", err)
	}
	mgr.m.ArenaUsed.Set(float64(mgr.arena.Used()))
}

func (mgr *Manager) alloc(ctx context.Context, n int64) (Region, error) {
	if n == 0 {
		return Region{}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, mgr.cfg.StagingWait)
	defer cancel()
	if wait := time.Until(mgr.fence); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return Region{}, fmt.Errorf("%w: the arena is fenced for %s after a crash (see --staging-wait): %w", ErrArenaFull, wait.Round(time.Millisecond), ctx.Err())
		}
	}
	r, err := mgr.arena.Alloc(ctx, n)
	if errors.Is(err, ErrArenaTooLarge) {
		err = fmt.Errorf("%w; the shard must fit the staging arena: restart the daemon with --staging-bytes of at least %d", err, n)
	}
	if err != nil {
		mgr.m.failed("alloc")
		return r, err
	}
	mgr.m.ArenaUsed.Set(float64(mgr.arena.Used()))
	return r, nil
}
