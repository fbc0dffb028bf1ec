package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/peercred"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/internal/server"
	"github.com/ckptd/ckptd/prefetch"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/storageurl"
)

// Options are the daemon's settings: ckptd serve's flags (whose help
// says what each does), each a field of the same name.
type Options struct {
	// URL and Job name the checkpoint store; Storage opens it and every
	// dataset source (S3 endpoint, region, retries, file mode).
	URL     string
	Job     string
	Storage storageurl.OpenOptions
	// Version is what the daemon reports of itself.
	Version string
	// StorageWait bounds how long the start waits for the checkpoint
	// store to answer (0: as long as its own retries, for a store that
	// comes up after the daemon).
	StorageWait time.Duration

	Socket          string
	SocketGroup     string
	ArenaDir        string
	StagingBytes    int64
	StagingWait     time.Duration
	LeaseTimeout    time.Duration
	ReuseFence      time.Duration
	TableBytes      int64
	Codec           string
	ChunkSize       int64
	SpreadData      bool
	Incremental     bool
	Workers         int
	Drains          int
	Restores        int
	MetricsAddr     string
	Grace           time.Duration
	DrainDelay      time.Duration
	CacheBytes      int64
	CacheLookahead  bool
	CacheAtStart    bool   // --cache-memory-at-start: take the cache's memory at start for S3 sources
	DiskCacheDir    string // --disk-cache-dir: the disk tier of remote sources' shards
	DiskCacheBytes  int64
	Nice            int
	RingSlots       int
	RingSlotsMax    int
	SlotBytes       int64
	RestartWait     time.Duration
	DatasetArena    int64 // 0: half of StagingBytes, unless DatasetsOff
	DatasetsOff     bool  // --dataset-arena-bytes 0: no dataset sessions at all
	DatasetAllow    []string
	ReadAhead       int64
	ListBytes       int64
	HotBytes        int64
	HotSteps        int
	PersistEvery    int
	PersistInterval time.Duration
	Peers           PeerOptions

	// StallWritesAfter stalls each write to the checkpoint store after
	// that many bytes (0: never); crash tests kill the daemon there.
	StallWritesAfter int64
	// SpillDir and SpillBytes: see staging.ManagerConfig.
	SpillDir   string
	SpillBytes int64
}

// explained is a start's error shown with the flags of the budgets it ran
// into (server.Explain): the core names a budget, not its flag.
type explained struct{ err error }

func (e explained) Error() string { return server.Explain(e.err) }
func (e explained) Unwrap() error { return e.err }

// UsageError is a setting the daemon cannot start with: the command
// exits 2 (bad usage) on one.
type UsageError struct{ Err error }

func (e UsageError) Error() string { return e.Err.Error() }
func (e UsageError) Unwrap() error { return e.Err }

// open opens a storage URL with the options' settings; only the
// checkpoint store may be created (create), dataset sources must exist.
func (o *Options) open(ctx context.Context, url string, create bool) (storage.Backend, error) {
	opts := o.Storage
	opts.MustExist = !create
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return storageurl.Open(ctx, url, opts)
}

// startupFault lets tests fail the start at a named step; nil in the
// daemon.
var startupFault func(step string) error

func fault(step string) error {
	if startupFault == nil {
		return nil
	}
	return startupFault(step)
}

// undoStack runs, last first, what takes back the steps of a start that
// failed, so that it leaves nothing behind.
type undoStack []func()

func (u *undoStack) push(f func()) { *u = append(*u, f) }

func (u *undoStack) run() {
	for i := len(*u) - 1; i >= 0; i-- {
		(*u)[i]()
	}
}

// Daemon is a started `ckptd serve`: its socket, storage, arena,
// checkpoint runtime, peers and dataset service, listening but not yet
// serving. Serve serves until its context ends; Close takes back a daemon
// that will not be served.
type Daemon struct {
	o         *Options
	log       *slog.Logger
	codec     codec.Codec
	gid       int
	undo      undoStack
	sp        *socketPlace
	b         storage.Backend
	a         *arena.Arena
	hot       *arena.Pool // the hot tier's memory, which clients map; nil: the heap
	place     *arenaPlace
	reg       *prometheus.Registry
	berrs     *backendErrors
	mgr       *staging.Manager
	pf        *prefetch.Service
	lis       net.Listener
	peers     *peers.Client
	peerCreds peers.Creds
	stopPeer  func()
	closers   []func() // run when serving ends (the peers' client, its watch)
}

// New checks everything that can fail cheaply (the options, the socket's
// folder, a daemon already on the socket, storage) before it allocates
// the arena, and takes back every step if a later one fails: the arena
// (what it created of it, and only while its journal is empty), the
// listener and the socket file, the socket folder it made. A setting it
// cannot start with is a UsageError.
func New(ctx context.Context, o *Options) (*Daemon, error) {
	d := &Daemon{o: o, log: slog.Default(), stopPeer: func() {}}
	var err error
	if d.codec, d.gid, err = o.check(); err != nil {
		return nil, UsageError{err}
	}
	// First, so that every report of a problem comes with the version
	// that had it.
	d.log.Info("ckptd starting", "version", o.Version, "pid", os.Getpid())
	if nice, err := lowerPriority(o.Nice); err != nil {
		d.log.Warn("could not lower the daemon's CPU priority (--nice)", "err", err)
	} else {
		d.log.Info("cpu priority", "nice", nice)
	}
	for _, step := range []func(context.Context) error{d.openPeers, d.openStorage, d.openArena, d.startManager, d.startPeers, d.startPrefetch, d.listen} {
		if err := step(ctx); err != nil {
			d.Close()
			return nil, explained{err}
		}
	}
	return d, nil
}

// Close takes back what New made, for a daemon that was never served.
func (d *Daemon) Close() {
	d.undo.run()
	d.undo = nil
	for _, c := range d.closers {
		c()
	}
	d.closers = nil
}

func (d *Daemon) openPeers(ctx context.Context) error {
	c, creds, err := d.o.Peers.setup(ctx, d.o.HotBytes, d.log)
	if err != nil {
		return UsageError{err}
	}
	if c != nil {
		d.peers, d.peerCreds = c, creds
		d.closers = append(d.closers, c.Close)
	}
	return nil
}

func (d *Daemon) openStorage(ctx context.Context) error {
	sp, err := prepareSocket(d.o.Socket, d.gid, d.log)
	if err != nil {
		return err
	}
	d.sp = sp
	d.undo.push(sp.undo)
	if err := waitSocketFree(ctx, sp.path, d.o.RestartWait, d.log); err != nil {
		return err
	}
	b, err := d.openStore(ctx)
	if err != nil {
		return err
	}
	d.b = b
	d.undo.push(func() { b.Close() })
	return fault("storage")
}

// openStore opens the checkpoint store, failing within StorageWait when
// it does not answer: a wrong endpoint is a mistake to report in seconds,
// not after every retry.
func (d *Daemon) openStore(ctx context.Context) (storage.Backend, error) {
	octx := ctx
	if d.o.StorageWait > 0 {
		var cancel context.CancelFunc
		octx, cancel = context.WithTimeout(ctx, d.o.StorageWait)
		defer cancel()
	}
	b, err := d.o.open(octx, d.o.URL, true)
	if err != nil && octx.Err() != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("%w; the storage did not answer within --storage-wait %s: check the endpoint and the network, "+
			"or give --storage-wait 0 to wait for a store that comes up after the daemon", err, d.o.StorageWait)
	}
	if err == nil && d.o.StallWritesAfter > 0 {
		f := faulty.New(b)
		f.Inject(faulty.Fault{Kind: faulty.StallPutAfter, N: d.o.StallWritesAfter, Delay: time.Hour})
		b = f
	}
	return b, err
}

func (d *Daemon) openArena(context.Context) error {
	a, place, err := openArena(d.o, d.sp, arena.Options{
		Size: d.o.StagingBytes, Lock: true, Logger: d.log,
		Shared: d.gid >= 0, SharedGID: d.gid, DeferShare: true, LockWait: d.o.RestartWait, Fence: d.o.ReuseFence, Owner: d.sp.path,
	}, d.log)
	if err != nil {
		return err
	}
	reapStale(place.dir, d.log)
	d.a, d.place = a, place
	d.undo.push(func() { _ = a.Discard() })
	if err := place.writePointer(); err != nil { // before any save is journaled, so that a restart finds them
		return err
	}
	d.undo.push(place.undoPointer)
	if err := d.openHot(); err != nil {
		return err
	}
	return fault("arena")
}

// openHot makes the hot tier's memory a file beside the arena that
// clients map read-only, so that a restore from it copies once (into the
// trainer's tensors), not twice. Not with --socket-group: a copy a member
// can read in place is one it could also have been handed to rewrite
// before (the daemon checks what it copies out instead).
func (d *Daemon) openHot() error {
	dir := filepath.Dir(d.a.Path())
	if !d.o.hotFile() {
		// A crashed daemon's file holds memory and nothing anyone needs.
		if err := os.Remove(filepath.Join(dir, arena.PoolFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	}
	p, err := arena.OpenPool(dir, d.o.HotBytes)
	if err != nil {
		return err
	}
	d.hot = p
	d.undo.push(func() { _ = p.Close() })
	return nil
}

func (d *Daemon) startManager(context.Context) error {
	o := d.o
	o.Workers = reserveIOProc(o.Workers)
	d.reg = prometheus.NewRegistry()
	d.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfo(o.Version),
		arenaLocked(d.a.Locked()))
	d.berrs = newBackendErrors(d.reg, backendStore, backendDataset)
	d.b = d.berrs.countStore(d.b, backendStore)
	var replicas tiers.Peers // nil unless configured: a nil *peers.Client is not
	if d.peers != nil {
		replicas = d.berrs.countPeers(d.peers)
	}
	mgr, err := staging.NewManager(server.CheckpointArena(d.a), d.b, staging.ManagerConfig{
		DefaultJob: o.Job, StagingWait: o.StagingWait, LeaseTimeout: o.LeaseTimeout, TableBudget: o.TableBytes, ReuseFence: o.ReuseFence,
		Drains: o.Drains, Restores: o.Restores, DrainDelay: o.DrainDelay, SpillDir: o.SpillDir, SpillBytes: o.SpillBytes, Logger: d.log, Metrics: staging.NewMetrics(d.reg),
		CheckCopies: o.SocketGroup != "", // other users can write the arena
		HotMapping:  d.hotMapping(),
		Tiers:       tiers.Config{HotBytes: o.HotBytes, HotSteps: o.HotSteps, PersistEvery: o.PersistEvery, PersistInterval: o.PersistInterval, Peers: replicas},
		Writer:      checkpoint.WriterOptions{ChunkSize: o.ChunkSize, Codec: d.codec, Workers: o.Workers, SpreadData: o.SpreadData, Incremental: o.Incremental},
	})
	if err != nil {
		return err
	}
	d.mgr = mgr
	d.undo.push(func() {
		stopNow, cancel := context.WithCancel(context.Background())
		cancel() // recovered saves stay journaled
		mgr.Close(stopNow)
	})
	// The Manager has summed what an earlier process journaled without a
	// copy check (it stays private to here until then): now the group may
	// map the arena.
	if err := d.a.Share(); err != nil {
		return err
	}
	return fault("manager")
}

// hotMapping is d.hot for the Manager: nil, not a nil *arena.Pool, when
// there is none.
func (d *Daemon) hotMapping() staging.HotMapping {
	if d.hot == nil {
		return nil
	}
	return d.hot
}

func (d *Daemon) startPeers(ctx context.Context) error {
	if d.peers == nil {
		return nil
	}
	addr, stop, err := peers.Listen(d.o.Peers.Listen, d.peerCreds, peers.NewServer(d.mgr.PeerSide(), d.o.HotBytes).Members(d.peers))
	if err != nil {
		return err
	}
	d.undo.push(stop)
	d.stopPeer = stop
	list, self := d.peers.Members()
	d.log.Info("peers: serving replicas", "listen", addr, "peers", list, "self", self, "replicas", d.o.Peers.Replicas, "tls", d.peerCreds.Protocol())
	wctx, stopWatch := context.WithCancel(context.Background())
	if d.o.Peers.Require {
		d.log.Info("peers: --peer-require: waiting for every peer to answer", "peers", len(list)-1)
		if err := d.peers.Probe(ctx, d.log); err != nil {
			stopWatch()
			return fmt.Errorf("--peer-require: %w", err)
		}
	} else {
		go func() { _ = d.peers.Probe(wctx, d.log) }() // stopped when serving ends; it logs what it finds
	}
	if d.o.Peers.discovery.Enabled() {
		go d.peers.Watch(wctx, d.o.Peers.discovery, d.log)
	}
	d.closers = append([]func(){stopWatch}, d.closers...)
	return nil
}

func (d *Daemon) startPrefetch(context.Context) error {
	o := d.o
	pcfg := o.prefetchConfig()
	pcfg.Logger, pcfg.Metrics = d.log, prefetch.NewMetrics(d.reg)
	pcfg.WrapSource = func(b storage.Backend) storage.Backend { return d.berrs.countStore(b, backendDataset) }
	pcfg.Open = func(ctx context.Context, url string) (storage.Backend, error) {
		b, err := o.open(ctx, url, false)
		return b, d.berrs.countOpen(backendDataset, err)
	}
	pa := server.PrefetchArena(d.a)
	limit := memoryCeiling(o, pcfg.MemoryCeiling(pa.Size()))
	setMemoryLimit(limit, d.log)
	pcfg.OffHeap = func(n int64) { lowerMemoryLimit(limit, n) }
	pf, err := prefetch.NewService(pa, pcfg)
	if err != nil {
		return err
	}
	d.pf = pf
	d.undo.push(pf.Close)
	return fault("prefetch")
}

func (d *Daemon) listen(context.Context) error {
	lis, err := listenUnix(d.sp.path, d.gid)
	if err != nil {
		return err
	}
	d.lis = lis
	d.undo.push(func() { lis.Close() })
	return fault("listen")
}

// Serve serves the socket (and /metrics) until ctx ends or the server
// fails, then shuts down: no new requests, the staged saves drained for
// up to --shutdown-grace and the rest left journaled for the next start.
func (d *Daemon) Serve(ctx context.Context) error {
	defer func() {
		for _, c := range d.closers {
			c()
		}
	}()
	o, log, b, a := d.o, d.log, d.b, d.a
	intake := newIntake(d.reg)
	srv := grpc.NewServer(slices.Concat(serverOptions(), intake.ServerOptions())...)
	reg := intake.Registrar(srv)
	server.Register(reg, d.mgr, a, d.hot)
	server.RegisterPrefetch(reg, d.pf, a)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(reg, hs)
	ready := newReadiness(b, o.Job, hs, log)
	server.RegisterDaemon(reg, d.mgr, d.pf, server.StatusConfig{Version: o.Version, Started: time.Now(), Storage: ready.check, BackendErrors: d.berrs.Counts})
	readyCtx, stopReady := context.WithCancel(context.Background())
	defer stopReady()
	go ready.run(readyCtx)
	stopMetrics := serveMetrics(o.MetricsAddr, d.reg, ready)
	log.Info("ckptd serving", "version", o.Version, "socket", d.sp.path, "storage", b.Location(), "job", o.Job,
		"arena", a.Path(), "staging_bytes", a.Size(), "locked", a.Locked(), "codec", d.codec)
	errc := make(chan error, 1)
	go func() {
		errc <- srv.Serve(intake.Listener(peercred.NewListener(d.lis.(peercred.UnixListener), peercred.Policy{UID: os.Geteuid(), GID: d.gid}, intake.Closed, log)))
	}()
	var err error
	select {
	case <-ctx.Done():
		log.Info("shutting down: no new requests; draining staged saves", "grace", o.Grace)
	case err = <-errc:
		log.Error("grpc server stopped", "err", err)
	}
	stopMetrics()
	stopReady()
	hs.Shutdown() // NOT_SERVING while draining
	stopGRPC(srv, 5*time.Second)
	d.stopPeer()
	d.pf.Close()
	removed, err := shutdown(d.mgr, a, o.Grace, err)
	if d.hot != nil { // its file goes; the mapping stays for what still reads it
		err = errors.Join(err, d.hot.Close())
	}
	if removed {
		d.place.removePointer()
	}
	b.Close()
	return err
}

// Run starts the daemon and serves it until ctx ends: New, then Serve.
func Run(ctx context.Context, o *Options) error {
	d, err := New(ctx, o)
	if err != nil {
		return err
	}
	return d.Serve(ctx)
}

// check validates the flags that need no storage, socket or arena, and
// returns the codec setting and the --socket-group gid (-1 for none).
func (o *Options) check() (codec.Codec, int, error) {
	c, err := codec.ParseSetting(o.Codec)
	if err != nil {
		return "", 0, err
	}
	gid, err := lookupGID(o.SocketGroup)
	if err != nil {
		return "", 0, err
	}
	if err := checkpoint.ValidateName("job", o.Job); err != nil {
		return "", 0, fmt.Errorf("--job: %w", err)
	}
	if o.PersistEvery < 0 || o.PersistEvery > 1 && o.HotBytes <= 0 {
		return "", 0, fmt.Errorf("--persist-every %d: want 1 (every step; 0 too), or more with --hot-bytes for the steps kept in memory only", o.PersistEvery)
	}
	if o.PersistInterval < 0 || o.PersistInterval > 0 && o.HotBytes <= 0 {
		return "", 0, fmt.Errorf("--persist-interval %s: want 0 (off), or more with --hot-bytes for the steps kept in memory only", o.PersistInterval)
	}
	if o.Nice < 0 || o.Nice > maxNice {
		return "", 0, fmt.Errorf("--nice %d: want 0 (keep the priority) to %d", o.Nice, maxNice)
	}
	if o.DatasetsOff && len(o.DatasetAllow) > 0 {
		return "", 0, fmt.Errorf("--dataset-arena-bytes 0 turns datasets off, yet --dataset-allow names sources: drop one of them")
	}
	if o.StagingBytes < 4096 {
		return "", 0, fmt.Errorf("--staging-bytes %d is less than one 4096-byte page", o.StagingBytes)
	}
	if o.SpillBytes < 0 || o.SpillBytes > 0 && o.SpillDir == "" {
		return "", 0, fmt.Errorf("--spill-bytes %d: want 0 (what the disk takes), or more with --spill-dir", o.SpillBytes)
	}
	// The writer's own checks (--chunk-size) without storage: it touches
	// its backend only when it drains.
	if _, err := checkpoint.NewWriter(nil, checkpoint.WriterOptions{ChunkSize: int64(o.ChunkSize), Codec: c, Workers: 1}); err != nil {
		return "", 0, fmt.Errorf("--chunk-size: %w", err)
	}
	return c, gid, nil
}

// serverOptions bound what one client connection can hold in the daemon
// (server.Intake bounds all of them together).
func serverOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		// A request is buffered whole before its handler runs. Tensor bytes
		// travel through the arena; 16 MiB is ample for a tensor table or
		// one message of a stream.
		grpc.MaxRecvMsgSize(pb.MaxMessageBytes),
		// Each stream is a goroutine and up to one request being read. A
		// trainer's saves, waits and dataset sessions need far fewer at
		// once; a client past the limit queues, it does not fail.
		grpc.MaxConcurrentStreams(128),
		// A peer that stops answering pings (a frozen process; a forked
		// DataLoader worker that inherited the connection of a trainer that
		// is gone, which keeps the socket open) is cut off after 2m20s, and
		// what its connection held is released. A unix socket reports a
		// peer that exited at once.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 2 * time.Minute, Timeout: 20 * time.Second}),
		// Clients may ping every 10s, even between calls (the default is
		// 5 minutes and only during calls), and no faster: a ping flood gets
		// GOAWAY.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		// A local client sends its preface at once; a connection that says
		// nothing is dropped after 5s instead of 120s.
		grpc.ConnectionTimeout(5 * time.Second),
		// ckptd's calls carry little metadata; the default allows 16 MiB
		// of headers a call.
		grpc.MaxHeaderListSize(64 << 10),
	}
}

// reserveIOProc returns the number of compression workers (workers, or one
// per available CPU) and, unless GOMAXPROCS is set by the user, gives the Go
// scheduler one processor more than that. During a drain the workers keep
// every processor busy; without a spare one, the backend's writer and the
// gRPC handlers wait up to a scheduler time slice (10 ms) each time they
// wake from a syscall, which starves the disk and lengthens the trainer's
// save stall.
func reserveIOProc(workers int) int {
	procs := runtime.GOMAXPROCS(0)
	if workers <= 0 {
		workers = procs
	}
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(max(procs, workers) + 1)
	}
	return workers
}

// shutdown drains what it can within grace, then leaves the rest journaled
// in the arena, which is kept for the next start only in that case. It
// reports whether it removed the arena.
func shutdown(mgr *staging.Manager, a *arena.Arena, grace time.Duration, err error) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if left := mgr.Close(ctx); left > 0 {
		slog.Warn("saves left journaled; they drain when ckptd serve starts again with the same arena", "saves", left, "arena", a.Path())
		return false, errors.Join(err, a.Close())
	}
	rmErr := a.Remove()
	return rmErr == nil, errors.Join(err, rmErr)
}

// stopGRPC finishes in-flight calls (a save being staged, a wait) for up
// to d, then cuts the rest off.
func stopGRPC(srv *grpc.Server, d time.Duration) {
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		srv.Stop()
	}
}

// lookupGID resolves --socket-group (a name or a number) to a gid, or -1
// when none is given.
func lookupGID(group string) (int, error) {
	if group == "" {
		return -1, nil
	}
	if gid, err := strconv.Atoi(group); err == nil && gid >= 0 {
		return gid, nil // a gid need not have a name (a container's fsGroup)
	}
	g, err := user.LookupGroup(group)
	if err != nil {
		return 0, fmt.Errorf("--socket-group %q: no such group", group)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("--socket-group %q: gid %q is not a number", group, g.Gid)
	}
	return gid, nil
}

// serveMetrics serves /metrics on addr (nothing when addr is empty) and
// returns a function that stops it.
func serveMetrics(addr string, reg *prometheus.Registry, ready *readiness) func() {
	if addr == "" {
		return func() {}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	ready.handlers(mux)
	hs := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Error("metrics server failed", "addr", addr, "err", err)
		}
	}()
	return func() { _ = hs.Close() }
}

// arenaLocked is ckptd_arena_locked: whether the arena is locked in memory,
// which a container needs IPC_LOCK or a large RLIMIT_MEMLOCK for; unlocked,
// it may be swapped and CUDA pins it slowly.
func arenaLocked(locked bool) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "ckptd_arena_locked",
		Help: "1 when the staging arena is locked in memory (mlock), 0 when it could not be (no IPC_LOCK, RLIMIT_MEMLOCK too small)."})
	if locked {
		g.Set(1)
	}
	return g
}

// buildInfo is ckptd_build_info: 1, labelled with the daemon's version and
// the Go it was built with, so that a dashboard can tell which nodes run
// what.
func buildInfo(version string) prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ckptd_build_info",
		Help: "1, labelled with the daemon's version and Go version."}, []string{"version", "goversion"})
	g.WithLabelValues(version, runtime.Version()).Set(1)
	return g
}

// newIntake bounds what the socket takes in (server.DefaultIntake) and
// counts it: ckptd_socket_connections and ckptd_socket_calls held now,
// ckptd_socket_refused_total{bound} refused past a bound.
func newIntake(reg prometheus.Registerer) *server.Intake {
	in := server.NewIntake(server.DefaultIntake)
	refused := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ckptd_socket_refused_total",
		Help: "Connections and calls the socket refused past its bounds, by bound (connections, calls)."}, []string{"bound"})
	for _, b := range []string{"connections", "calls"} {
		refused.WithLabelValues(b) // present at 0, so that an alert on its rate has a series
	}
	in.Refused = func(bound string) { refused.WithLabelValues(bound).Inc() }
	reg.MustRegister(refused,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ckptd_socket_connections", Help: "Client connections open on the socket."},
			func() float64 { c, _ := in.Held(); return float64(c) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ckptd_socket_calls", Help: "Calls in progress on the socket."},
			func() float64 { _, c := in.Held(); return float64(c) }))
	return in
}
