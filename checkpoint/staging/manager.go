package staging

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
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
	// ReuseFence is how long the save region of a client whose connection
	// ended is kept when its Owner cannot tell whether the process has
	// exited (default 10s; see Owner). The daemon's --crash-fence sets it,
	// and fences its arena for as long after a crash (the arena's own
	// option: no region is handed out, to saves or to dataset rings, while
	// a dead daemon's clients may still be copying).
	ReuseFence time.Duration
	// Drains is how many shards drain at once (default 2); chunk-level
	// parallelism is WriterOptions.Workers.
	Drains int
	// Restores is how many restores read from storage at once (default
	// 4); more wait their turn. Each holds Read.Concurrency chunk buffers
	// and its manifest in memory, so this bounds the heap restores take.
	Restores int
	// Tiers configures the memory tiers: the hot tier, the peers and the
	// persistent tier policy. NewManager fills in their backend, logger,
	// failure count and how they persist a held shard.
	Tiers   tiers.Config
	Writer  checkpoint.WriterOptions
	Read    checkpoint.ReadOptions
	Metrics *Metrics
	Logger  *slog.Logger
	// DrainDelay delays every drain; tests use it to crash the daemon
	// while a save is accepted but not yet durable.
	DrainDelay time.Duration
	// SpillDir, when set, is a local-disk folder that staged saves waiting
	// to drain move to when the arena has no room for a new save (storage
	// does not take bytes, or not as fast as saves come; see spill), at
	// most SpillBytes of them (0: as much as the disk takes). A save then
	// fails for room only when the spill is full too.
	SpillDir   string
	SpillBytes int64
	// CheckCopies asks every client that copies into the arena for the
	// hashes of what it copied (checkpoint.CopyCheck), and stores a save
	// only if its bytes still hash the same when they drain: set when other
	// users may write the arena (the daemon's --socket-group), so that
	// bytes one rewrote in another's save are not stored.
	CheckCopies bool
	// HotMapping, when set (and CheckCopies not), is shared memory the hot
	// tier keeps its shards in, which clients map read-only: a restore
	// from the hot tier that asks for it (RestoreRequest.InPlace) gets the
	// hot copy's bytes there, verified, instead of a copy in the arena.
	HotMapping HotMapping
}

// HotMapping is the hot tier's shared memory as restores hand it out: a
// piece's offset in the file clients map, and the file's identity.
type HotMapping interface {
	tiers.Memory
	Offset(b []byte) (int64, bool)
	ID() string
}

// The ManagerConfig defaults; the daemon's flags default to them too.
const (
	DefaultStagingWait  = 30 * time.Second
	DefaultLeaseTimeout = 30 * time.Minute
	DefaultTableBudget  = 256 << 20
	DefaultReuseFence   = 10 * time.Second
	DefaultDrains       = 2
	DefaultRestores     = 4
)

func (c *ManagerConfig) setDefaults() {
	if c.StagingWait <= 0 {
		c.StagingWait = DefaultStagingWait
	}
	if c.LeaseTimeout <= 0 {
		c.LeaseTimeout = DefaultLeaseTimeout
	}
	if c.TableBudget <= 0 {
		c.TableBudget = DefaultTableBudget
	}
	if c.ReuseFence <= 0 {
		c.ReuseFence = DefaultReuseFence
	}
	if c.Drains <= 0 {
		c.Drains = DefaultDrains
	}
	if c.Restores <= 0 {
		c.Restores = DefaultRestores
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics(nil)
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
	arena Arena
	b     storage.Backend
	w     *checkpoint.Writer
	log   *slog.Logger
	m     *Metrics

	mu      sync.Mutex // guards leases, queue and closing
	leases  leaseTable
	queue   drainQueue
	closing bool
	saves   *saveStates // by rank: what Wait and Status answer from

	restores chan struct{} // a slot per restore reading from storage (Restores)
	tiers    *tiers.Tiers
	// stalled is set while drains retry storage errors (nil once one
	// succeeds): an arena full of their saves is named for the outage.
	stalled atomic.Pointer[drainStall]
	// storageDown is set while saves' looks at storage for their step's
	// commit record get no answer (see precheck): saves are not held for
	// the next ones.
	storageDown atomic.Bool

	ctx      context.Context // cancelled to abandon drains at shutdown
	cancel   context.CancelFunc
	wg       sync.WaitGroup // drains and the reaper
	checks   sync.WaitGroup // saves' looks at storage (precheck), stopped by cancel
	watchers sync.WaitGroup // watchOwner goroutines, stopped by cancel

	spill       *spill       // nil without ManagerConfig.SpillDir
	spilling    sync.Mutex   // one spiller at a time
	spillLogged atomic.Int64 // when a failed spill was last logged (UnixNano)
}

// NewManager starts the checkpoint core on an open arena: it re-queues the
// saves journaled by an earlier process (nothing acknowledged is lost) and
// starts the drain workers. Close stops them.
func NewManager(a Arena, b storage.Backend, cfg ManagerConfig) (*Manager, error) {
	cfg.setDefaults()
	if err := checkpoint.ValidateName("job", cfg.DefaultJob); err != nil {
		return nil, fmt.Errorf("default job: %w", err)
	}
	w, err := checkpoint.NewWriter(b, cfg.Writer)
	if err != nil {
		return nil, err
	}
	mgr := &Manager{
		cfg: cfg, arena: a, b: b, w: w, log: cfg.Logger, m: cfg.Metrics,
		leases: newLeaseTable(cfg.TableBudget, cfg.Metrics.TableBytes), saves: newSaveStates(),
		queue: drainQueue{wake: make(chan struct{}, 1)}, restores: make(chan struct{}, cfg.Restores),
	}
	if cfg.CheckCopies {
		cfg.HotMapping = nil // others could rewrite what a client reads in place
	}
	tc := cfg.Tiers
	if cfg.HotMapping != nil {
		tc.HotMemory = cfg.HotMapping
	}
	tc.Backend, tc.Logger, tc.Failed, tc.PersistHeld = b, cfg.Logger, mgr.m.failed, mgr.persistHeld
	mgr.m.followArena(a)
	mgr.ctx, mgr.cancel = context.WithCancel(context.Background())
	mgr.tiers = tiers.New(tc)
	if cfg.SpillDir != "" {
		if mgr.spill, err = openSpill(cfg.SpillDir, cfg.SpillBytes); err != nil {
			mgr.tiers.Close()
			return nil, err
		}
		mgr.m.Spilled.Set(float64(mgr.spill.usedBytes()))
	}
	if err := mgr.recover(); err != nil {
		mgr.tiers.Close()
		if mgr.spill != nil {
			mgr.spill.close()
		}
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

// jobStore is the Store of the job a request names (the default job when
// it names none), once its name is checked.
func (mgr *Manager) jobStore(job string) (*checkpoint.Store, error) {
	s, err := checkpoint.NewStore(mgr.b, mgr.job(job))
	if err != nil {
		return nil, err
	}
	return s.WithLogger(mgr.log), nil
}

func (mgr *Manager) job(j string) string {
	if j == "" {
		return mgr.cfg.DefaultJob
	}
	return j
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
	mgr.tiers.Refuse()
	mgr.queue.signal()
	done := make(chan struct{})
	go func() { mgr.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		mgr.cancel()
		<-done
	}
	mgr.cancel()
	mgr.tiers.Close()
	mgr.watchers.Wait()
	mgr.checks.Wait()
	if mgr.spill != nil {
		mgr.spill.close()
	}
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	return mgr.leases.journaled()
}

func (mgr *Manager) freeRegion(r Region) {
	if r.Length == 0 {
		return
	}
	if err := mgr.arena.Free(r); err != nil {
		mgr.log.Error("arena free failed", "err", err)
	}
}

func (mgr *Manager) alloc(ctx context.Context, n int64) (Region, error) {
	return mgr.allocWith(ctx, n, mgr.arena.Alloc)
}

// allocWriter allocates a region a client writes into: a save's. A save
// that finds no room at once, when there is a spill folder, moves saves
// waiting to drain there to make it: storage does not take bytes, or not
// as fast as the trainer saves (a drain that retries through an outage
// takes minutes to give up on a request), and the trainer goes on.
func (mgr *Manager) allocWriter(ctx context.Context, n int64) (Region, error) {
	if mgr.spill == nil {
		return mgr.allocWith(ctx, n, mgr.arena.AllocWriter)
	}
	return mgr.allocWith(ctx, n, func(ctx context.Context, n int64) (Region, error) {
		for {
			qctx, cancel := context.WithTimeout(ctx, spillAfter)
			r, err := mgr.arena.AllocWriter(qctx, n)
			cancel()
			if err == nil || !errors.Is(err, ErrArenaFull) || ctx.Err() != nil {
				return r, err
			}
			mgr.spillSome(n) // the saves waiting to drain, if any
		}
	})
}

func (mgr *Manager) allocWith(ctx context.Context, n int64, alloc func(context.Context, int64) (Region, error)) (Region, error) {
	if n == 0 {
		return Region{}, nil
	}
	// The wait ends before the caller's deadline, with room to answer:
	// ARENA_FULL naming the budget says more than the caller's own
	// deadline, and an answer sent as the caller gives up races its
	// cancelling the call.
	wait := mgr.cfg.StagingWait
	if dl, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(dl)*9/10)
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	r, err := alloc(ctx, n)
	if errors.Is(err, ErrArenaTooLarge) {
		err = budget.Wrap(fmt.Errorf("%w; the shard must fit the staging arena: restart the daemon with an arena of at least %d bytes", err, n), budget.StagingArena)
	}
	if s := mgr.stalled.Load(); s != nil && errors.Is(err, ErrArenaFull) {
		err = fmt.Errorf("%w; the arena is held by staged saves whose drains have been retrying for %s because storage does not answer: %v",
			err, time.Since(s.since).Round(time.Second), s.err)
	}
	if err != nil {
		mgr.m.failed("alloc")
		return r, err
	}
	return r, nil
}

// drainStall is a storage outage the drains are riding out: since when,
// and the last error.
type drainStall struct {
	since time.Time
	err   error
}
