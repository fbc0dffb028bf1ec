package prefetch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

var (
	// ErrUnknownSession: no dataset session (or delivery) of that id.
	ErrUnknownSession = errors.New("unknown dataset session")
	// ErrClosed: the service is shutting down.
	ErrClosed = errors.New("dataset service is shutting down")
)

// OpenFunc opens the backend of an S3 source URL (storageurl.Open).
type OpenFunc func(ctx context.Context, url string) (storage.Backend, error)

// ServiceConfig configures the daemon's prefetch service.
type ServiceConfig struct {
	// CacheBytes is the shard cache budget shared by all sessions.
	CacheBytes int64
	// DiskCacheDir and DiskCacheBytes are the disk tier (serve's
	// --disk-cache-dir, --disk-cache-bytes): the shards of remote sources
	// kept on a local disk (see diskCache); no dir, no tier.
	DiskCacheDir   string
	DiskCacheBytes int64
	// CacheAtStart takes the shard buffers' memory (the cache's budget
	// and a session's read-ahead budget: see slack) at start, in the
	// background, when an S3 source is allowed (serve's
	// --cache-memory-at-start): a first epoch from S3 then finds its
	// pages taken instead of taking them as its shards come (see
	// shardMem). The first iteration opened stops it (Cache.endTake).
	// Local sources' shards are mapped: they need none; with no cache
	// (CacheBytes 0) nothing is taken.
	CacheAtStart bool
	// OffHeap, if set, is told the bytes of shard memory the service
	// holds outside the Go heap whenever they change (see shardMem):
	// ckptd serve lowers the heap's soft memory limit by them, since the
	// garbage collector does not see them.
	OffHeap func(bytes int64)
	// NoLookahead makes a full cache keep what it holds instead of
	// following the open sessions' known orders (Belady's rule): the
	// policy the lookahead replaced, kept to compare against.
	NoLookahead bool
	// Slots and SlotBytes size each session's ring (defaults 4 × 16 MiB).
	Slots     int
	SlotBytes int64
	// MaxSlots is what a ring may grow to when its trainer catches up
	// with it (default 2 × Slots; at most Slots means never): see Ring.
	MaxSlots int
	// ArenaBytes is the datasets' share of the staging arena (serve's
	// --dataset-arena-bytes; default half the arena): ring slots and
	// oversized batches are charged to it, so that dataset sessions can
	// never take all the room checkpoint saves are staged in.
	ArenaBytes int64
	// AllocWait bounds the wait for arena space for a new session's ring
	// (default 30s), as --staging-wait does for saves.
	AllocWait time.Duration
	// IdleTimeout closes sessions nobody asked for a batch for (default 10m),
	// so a trainer that died does not pin its ring.
	IdleTimeout time.Duration
	// Allow lists the sources trainers may read (serve's --dataset-allow):
	// folders and s3://bucket/prefix entries; none allows nothing.
	Allow []string
	// Off turns datasets off (serve's --dataset-arena-bytes 0): sessions
	// are refused, saying so, and the service takes no memory. With no
	// source allowed they are off too.
	Off bool
	// ArenaDir is never a source, even beneath an allowed folder
	// (default: the arena's folder, which holds its journal).
	ArenaDir string
	// MaxBackends bounds the sources open at once (DefaultMaxBackends);
	// one unused for BackendIdle (DefaultBackendIdle) is closed.
	MaxBackends int
	BackendIdle time.Duration
	Options     Options
	Open        OpenFunc
	// WrapSource, if set, wraps each source's backend (a local folder's
	// or Open's) when a session first opens it: ckptd serve counts the
	// source's failed reads so.
	WrapSource func(storage.Backend) storage.Backend
	Logger     *slog.Logger
	Metrics    *Metrics
}

// Service runs dataset sessions for the daemon: one per rank's epoch, each
// an Iterator feeding a Ring. It knows nothing of gRPC.
type Service struct {
	cfg    ServiceConfig
	allow  *allowList
	arena  Arena
	budget *arenaBudget
	cache  *Cache

	backends *backendPool

	mu       sync.Mutex
	closed   bool
	sessions map[string]*session
	watched  map[string]bool // owners whose Done a goroutine watches
	stop     chan struct{}
	wg       sync.WaitGroup

	primeTimer func(time.Duration, func()) *time.Timer // each session's (see session.primeTimer)
}

// The ServiceConfig defaults; the daemon's flags default to them too.
const (
	DefaultSlots       = 4
	DefaultSlotBytes   = 16 << 20
	DefaultAllocWait   = 30 * time.Second
	DefaultIdleTimeout = 10 * time.Minute
)

// setDefaults fills in what cfg leaves zero, for an arena of arenaSize
// bytes.
func (cfg *ServiceConfig) setDefaults(arenaSize int64) {
	if cfg.Slots <= 0 {
		cfg.Slots = DefaultSlots
	}
	if cfg.SlotBytes <= 0 {
		cfg.SlotBytes = DefaultSlotBytes
	}
	if cfg.MaxSlots == 0 {
		cfg.MaxSlots = 2 * cfg.Slots
	}
	cfg.MaxSlots = max(cfg.MaxSlots, cfg.Slots)
	if cfg.AllocWait <= 0 {
		cfg.AllocWait = DefaultAllocWait
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	cfg.Options.setDefaults()
	if cfg.ArenaBytes <= 0 {
		cfg.ArenaBytes = arenaSize / 2
	}
}

// NewService starts the prefetch service on the daemon's arena.
func NewService(a Arena, cfg ServiceConfig) (*Service, error) {
	cfg.setDefaults(a.Size())
	if cfg.ArenaBytes > a.Size() {
		return nil, budget.Wrap(fmt.Errorf("%w: the datasets' share of the arena, %d bytes, exceeds the arena's %d", ErrInvalid, cfg.ArenaBytes, a.Size()),
			budget.DatasetShare, budget.StagingArena)
	}
	if cfg.ArenaDir == "" {
		cfg.ArenaDir = filepath.Dir(a.Path())
	}
	allow, err := newAllowList(cfg.Allow, []string{cfg.ArenaDir})
	if err != nil {
		return nil, err
	}
	switch {
	case cfg.Off:
		cfg.Logger.Info("datasets are off: they have no share of the arena")
	case len(cfg.Allow) == 0:
		cfg.Logger.Info("no dataset sources are allowed: datasets are off until some are")
	}
	if cfg.off() {
		cfg.CacheBytes = 0 // nothing to cache: the memory ceiling counts none
	}
	c, err := NewCache(cfg.CacheBytes)
	if err != nil {
		return nil, err
	}
	if cfg.NoLookahead {
		c.ahead = nil
	}
	switch {
	case cfg.DiskCacheDir == "" && cfg.DiskCacheBytes > 0:
		c.Close()
		return nil, budget.Wrap(fmt.Errorf("%w: the disk tier has a size but no folder", ErrInvalid), budget.DiskCache)
	case cfg.DiskCacheDir != "" && !cfg.off():
		if c.disk, err = newDiskCache(cfg.DiskCacheDir, cfg.DiskCacheBytes, cfg.Logger); err != nil {
			c.Close()
			return nil, err
		}
		c.disk.hit, c.disk.usage = cfg.Metrics.DiskHits.Inc, func(n int64) { cfg.Metrics.DiskBytes.Set(float64(n)) }
		cfg.Metrics.DiskBytes.Set(float64(c.disk.used)) // what earlier runs left
	}
	s := &Service{
		cfg: cfg, allow: allow, arena: a, budget: newArenaBudget(cfg.ArenaBytes), cache: c, stop: make(chan struct{}),
		backends: newBackendPool(cfg.MaxBackends, cfg.BackendIdle),
		sessions: map[string]*session{}, watched: map[string]bool{}, primeTimer: time.AfterFunc,
	}
	c.mem.onHeld = cfg.OffHeap
	c.mem.resize(cfg.CacheBytes, slack(cfg.Options.ReadAheadBytes))
	if cfg.takesMemoryAtStart(allow) {
		c.takeMemory(cfg.Logger)
	}
	s.wg.Go(s.reapLoop)
	cfg.Logger.Info("dataset service", "allow", cfg.Allow, "cache_bytes", cfg.CacheBytes,
		"disk_cache_dir", cfg.DiskCacheDir, "disk_cache_bytes", cfg.DiskCacheBytes,
		"read_ahead_bytes", s.cfg.Options.ReadAheadBytes, "arena_bytes", cfg.ArenaBytes,
		"max_sessions", s.MaxSessions(), "memory_ceiling", s.MemoryCeiling())
	return s, nil
}

// takesMemoryAtStart says whether the service takes its shard buffers'
// memory at start (CacheAtStart): for a cache, and an S3 source to fill it.
func (cfg *ServiceConfig) takesMemoryAtStart(allow *allowList) bool {
	return cfg.CacheAtStart && !cfg.off() && cfg.CacheBytes > 0 && len(allow.s3) > 0
}

// MaxSessions is how many sessions the datasets' share of the arena holds
// rings for: no more can be open at once.
func (s *Service) MaxSessions() int64 { return s.cfg.maxSessions() }

func (cfg *ServiceConfig) maxSessions() int64 {
	return cfg.ArenaBytes / (int64(cfg.Slots) * cfg.SlotBytes)
}

// MemoryCeiling bounds the memory the dataset service holds, whatever the
// datasets and clients do: the cache, per session its read-ahead budget,
// the buffer of a streamed shard and its dataset's listing, and the keys
// and names of the deliveries the rings hold (a turn per slot, and every
// slot is charged to the datasets' share of the arena, however the rings
// grow). A session takes its ring before it lists or reads, so no more
// than the share fits are opening at once. (The rings are in the arena,
// counted in --staging-bytes; the Go runtime may hold up to GOGC% more as
// garbage unless GOMEMLIMIT says otherwise.)
func (s *Service) MemoryCeiling() int64 { return s.cfg.MemoryCeiling(s.arena.Size()) }

// MemoryCeiling is Service.MemoryCeiling for a service that cfg would
// start on an arena of arenaSize bytes, without starting it (`ckptd serve
// --print-memory`).
func (cfg ServiceConfig) MemoryCeiling(arenaSize int64) int64 {
	if cfg.off() {
		return 0
	}
	cfg.setDefaults(arenaSize)
	perSession := cfg.Options.ReadAheadBytes + streamBuffer + cfg.Options.ListBytes
	return cfg.CacheBytes + slack(cfg.Options.ReadAheadBytes) + CountBytes + FooterBytes + cfg.maxSessions()*perSession + cfg.ArenaBytes/cfg.SlotBytes*maxBatchMeta
}

// off reports whether datasets are off: Off, or no source allowed.
func (cfg ServiceConfig) off() bool { return cfg.Off || len(cfg.Allow) == 0 }

// Cache returns the shard cache (for metrics).
func (s *Service) Cache() *Cache { return s.cache }

// Close ends every session and releases their rings, the backends and
// the cache.
func (s *Service) Close() {
	close(s.stop)
	s.wg.Wait()
	s.mu.Lock()
	sessions := s.sessions
	s.sessions, s.closed = map[string]*session{}, true
	s.mu.Unlock()
	for _, ss := range sessions {
		ss.close()
	}
	s.backends.close()
	s.cache.Close()
}

// OpenSession starts one rank's iteration over one epoch of source for
// owner, and returns the session's id.
func (s *Service) OpenSession(ctx context.Context, owner Owner, source string, spec Spec) (string, Stats, error) {
	return s.open(ctx, owner, []MixtureSource{{Source: source, Format: spec.Format, Weight: 1}}, spec, false)
}

// MixtureSource is one source of a mixture, as a client names it.
type MixtureSource struct {
	Source string
	Format Format
	Weight float64
}

// OpenMixture starts one rank's iteration over one epoch of a mixture of
// sources (see OpenMixture) for owner, and returns the session's id.
func (s *Service) OpenMixture(ctx context.Context, owner Owner, sources []MixtureSource, spec Spec) (string, Stats, error) {
	if len(sources) == 0 || len(sources) > MaxMixSources {
		return "", Stats{}, fmt.Errorf("%w: a mixture of %d sources: give 1 to %d", ErrInvalid, len(sources), MaxMixSources)
	}
	return s.open(ctx, owner, sources, spec, true)
}

// open opens a session over sources: one source's dataset, or a mixture.
func (s *Service) open(ctx context.Context, owner Owner, sources []MixtureSource, spec Spec, mixture bool) (string, Stats, error) {
	if s.cfg.Off {
		return "", Stats{}, budget.Wrap(fmt.Errorf("%w: datasets are off: this daemon gives them no share of its arena", ErrOverBudget), budget.DatasetShare)
	}
	var refs []*backendRef
	release := func() {
		for _, br := range refs {
			s.backends.release(br)
		}
	}
	for _, ms := range sources {
		src, err := s.allow.resolve(ms.Source)
		if err != nil {
			release()
			return "", Stats{}, err
		}
		br, err := s.backends.acquire(ctx, src.key, func(ctx context.Context) (storage.Backend, error) {
			b, err := s.openSource(ctx, src, ms.Source)
			if err == nil && s.cfg.WrapSource != nil {
				b = s.cfg.WrapSource(b)
			}
			return b, err
		})
		if err != nil {
			release()
			return "", Stats{}, err
		}
		refs = append(refs, br)
	}
	if err := spec.Validate(); err != nil {
		release()
		return "", Stats{}, err
	}
	// The ring first: the arena's share bounds the sessions open at once,
	// and so the listings and reads ahead that opening starts.
	ring, err := newRing(ctx, s.arena, s.budget, s.cfg.Slots, s.cfg.MaxSlots, s.cfg.SlotBytes, s.cfg.AllocWait)
	if err != nil {
		release()
		return "", Stats{}, err
	}
	var it *Iterator
	if mixture {
		mix := make([]MixSource, len(sources))
		for i, ms := range sources {
			mix[i] = MixSource{Backend: refs[i].b, Format: ms.Format, Weight: ms.Weight}
		}
		it, err = OpenMixture(ctx, mix, s.cache, spec, s.cfg.Options)
	} else {
		it, err = Open(ctx, refs[0].b, "", s.cache, spec, s.cfg.Options)
	}
	if err != nil {
		ring.Close()
		release()
		return "", Stats{}, err
	}
	ss := newSession(newID(), owner.ID, it, ring, s.cfg.Metrics, s.primeTimer)
	ss.onClose = release
	ss.peer, ss.source, ss.spec = owner.Peer, sources[0].Source, spec
	if mixture {
		names := make([]string, len(sources))
		for i, ms := range sources {
			names[i] = redact(ms.Source)
		}
		ss.source = "mixture of " + strings.Join(names, ", ")
	}
	if err := s.insert(owner, ss); err != nil {
		ss.close()
		return "", Stats{}, err
	}
	return ss.id, it.Stats(), nil
}

// openSource opens the backend of a resolved source.
func (s *Service) openSource(ctx context.Context, src resolved, source string) (storage.Backend, error) {
	if src.real != "" {
		return openLocal(src.real, s.allow)
	}
	b, err := s.cfg.Open(ctx, src.url)
	if err != nil {
		return nil, openError(ctx, source, err)
	}
	return b, nil
}

// insert registers a new session of owner and makes sure the owner's
// connection is watched. A session of an owner already gone is taken out
// again at once: the check runs after the insert, under the lock the
// watcher takes, so the watcher either sees the session or the check sees
// the owner gone.
func (s *Service) insert(owner Owner, ss *session) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.sessions[ss.id] = ss
	s.cfg.Metrics.Sessions.Set(float64(len(s.sessions)))
	if owner.gone() {
		delete(s.sessions, ss.id)
		s.cfg.Metrics.Sessions.Set(float64(len(s.sessions)))
		return fmt.Errorf("%w: the connection that opened it has closed", context.Canceled)
	}
	if owner.Done != nil && !s.watched[owner.ID] {
		s.watched[owner.ID] = true
		s.wg.Go(func() { s.watch(owner) })
	}
	return nil
}

// watch closes the owner's sessions when its connection closes.
func (s *Service) watch(owner Owner) {
	select {
	case <-owner.Done:
	case <-s.stop:
		return
	}
	s.mu.Lock()
	delete(s.watched, owner.ID)
	var mine []*session
	for id, ss := range s.sessions {
		if ss.owner == owner.ID {
			mine = append(mine, ss)
			delete(s.sessions, id)
		}
	}
	s.cfg.Metrics.Sessions.Set(float64(len(s.sessions)))
	s.mu.Unlock()
	if len(mine) > 0 {
		s.cfg.Logger.Debug("closing the dataset sessions of a closed connection", "conn", owner.ID, "sessions", len(mine))
	}
	for _, ss := range mine {
		ss.close()
	}
}

// session returns owner's session id; another owner's is unknown.
func (s *Service) session(owner Owner, id string) (*session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ss := s.sessions[id]
	if ss == nil || ss.owner != owner.ID {
		return nil, unknownSession(id)
	}
	ss.touch()
	return ss, nil
}

func unknownSession(id string) error {
	return fmt.Errorf("%w: %q (closed, idle too long, opened by another connection, or never opened)", ErrUnknownSession, id)
}

// Next releases the deliveries named in release, then returns the
// session's next batch and the id of its delivery, or io.EOF after the
// last one. Stats are the session's totals so far.
func (s *Service) Next(ctx context.Context, owner Owner, id string, release []string) (*Delivery, string, Stats, error) {
	ss, err := s.session(owner, id)
	if err != nil {
		return nil, "", Stats{}, err
	}
	for _, lease := range release {
		if err := ss.release(lease); err != nil {
			return nil, "", Stats{}, err
		}
	}
	return ss.next(ctx)
}

// Release gives back owner's delivery lease of session id (and those
// delivered before it), as Next's release does.
func (s *Service) Release(owner Owner, id, lease string) error {
	ss, err := s.session(owner, id)
	if err != nil {
		return err
	}
	return ss.release(lease)
}

// Undeliver takes back a delivery whose response could not be sent (the
// call ended as it was answered): the session's next call hands it out
// again, so the client neither loses its samples nor holds its slot.
func (s *Service) Undeliver(owner Owner, id, lease string) {
	if ss, err := s.session(owner, id); err == nil {
		ss.undeliver(lease)
	}
}

// CloseSession ends owner's session and frees its ring.
// Position returns, encoded, the samples session id of owner has
// delivered once its consumer holds position samples (see
// Iterator.Delivered), and how many they are.
func (s *Service) Position(owner Owner, id string, position int64) ([]byte, int64, error) {
	s.mu.Lock()
	ss := s.sessions[id]
	s.mu.Unlock()
	if ss == nil || ss.owner != owner.ID {
		return nil, 0, unknownSession(id)
	}
	ss.touch()
	d, err := ss.it.Delivered(position)
	if err != nil {
		return nil, 0, err
	}
	return d.Encode(), d.Count(), nil
}

func (s *Service) CloseSession(owner Owner, id string) error {
	s.mu.Lock()
	ss := s.sessions[id]
	if ss == nil || ss.owner != owner.ID {
		s.mu.Unlock()
		return unknownSession(id)
	}
	delete(s.sessions, id)
	s.cfg.Metrics.Sessions.Set(float64(len(s.sessions)))
	s.mu.Unlock()
	ss.close()
	return nil
}

func (s *Service) reapLoop() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			for _, ss := range s.idle(now) {
				s.cfg.Logger.Warn("closed an idle dataset session", "session", ss.id, "idle", s.cfg.IdleTimeout)
				ss.close()
			}
			s.backends.reap()
		}
	}
}

// idle takes the sessions nobody used for IdleTimeout out of the service.
func (s *Service) idle(now time.Time) []*session {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*session
	for id, ss := range s.sessions {
		if now.Sub(ss.lastUsed()) > s.cfg.IdleTimeout {
			out = append(out, ss)
			delete(s.sessions, id)
		}
	}
	s.cfg.Metrics.Sessions.Set(float64(len(s.sessions)))
	return out
}
