package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/user"
	"runtime"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
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
)

type serveOptions struct {
	storageOptions
	Socket          string
	SocketGroup     string
	ArenaDir        string
	StagingBytes    byteSize
	StagingWait     time.Duration
	LeaseTimeout    time.Duration
	ReuseFence      time.Duration
	TableBytes      byteSize
	Codec           string
	ChunkSize       byteSize
	Workers         int
	Drains          int
	Restores        int
	MetricsAddr     string
	Grace           time.Duration
	DrainDelay      time.Duration
	CacheBytes      byteSize
	CacheLookahead  bool
	Nice            int
	RingSlots       int
	RingSlotsMax    int
	SlotBytes       byteSize
	RestartWait     time.Duration
	DatasetArena    byteSize
	DatasetAllow    []string
	ReadAhead       byteSize
	ListBytes       byteSize
	PrintMemory     bool
	HotBytes        byteSize
	HotSteps        int
	PersistEvery    int
	PersistInterval time.Duration
	peerOptions
}

func newServeCmd() *cobra.Command {
	o := &serveOptions{StagingBytes: 1 << 30, ChunkSize: checkpoint.DefaultChunkSize, CacheBytes: 1 << 30,
		SlotBytes: prefetch.DefaultSlotBytes, TableBytes: staging.DefaultTableBudget,
		ReadAhead: prefetch.DefaultReadAheadBytes, ListBytes: prefetch.DefaultListBytes}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the sidecar: accept saves over a unix socket, drain them to storage, and serve datasets",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runServe(cmd.Context(), o, cmd.OutOrStdout()) },
	}
	fs := cmd.Flags()
	o.storageOptions.register(fs)
	o.peerOptions.register(fs)
	fs.StringVar(&o.Socket, "socket", "", "unix socket to listen on (default $CKPTD_SOCKET, else $XDG_RUNTIME_DIR/ckptd.sock, else /tmp/ckptd-<uid>/ckptd.sock)")
	fs.StringVar(&o.SocketGroup, "socket-group", "", "group (name or gid) whose members may use the socket and map the arena, besides its owner")
	fs.StringVar(&o.ArenaDir, "arena-dir", "", "shared-memory folder of the staging arena (default /dev/shm/ckptd-<uid>-<hash of socket path>, or a fresh name recorded next to the socket if another user holds that one)")
	fs.DurationVar(&o.RestartWait, "restart-wait", 30*time.Second, "how long to wait for a previous daemon that is exiting (killed a moment ago: unmapping a large arena takes seconds) to release the socket and the arena; a running one fails the start at once")
	fs.Var(&o.StagingBytes, "staging-bytes", "size of the shared-memory staging arena (e.g. 8GiB)")
	fs.DurationVar(&o.StagingWait, "staging-wait", staging.DefaultStagingWait, "how long a save waits for arena space before failing")
	fs.DurationVar(&o.ReuseFence, "crash-fence", staging.DefaultReuseFence, "after a crash, how long new saves, restores and dataset rings wait before using arena space the dead daemon's clients may still be copying into; also how long a gone client's save region is kept when its process cannot be seen")
	fs.DurationVar(&o.LeaseTimeout, "lease-timeout", staging.DefaultLeaseTimeout, "end saves never committed and restores never released after this (a client that disconnects frees them at once)")
	fs.Var(&o.TableBytes, "tensor-table-bytes", "memory for the tensor tables and metadata of open saves, and 1 KiB per open restore; a save or restore that would exceed it fails with RESOURCE_EXHAUSTED")
	fs.StringVar(&o.Codec, "codec", string(codec.Auto), "chunk codec: auto (per chunk by dtype: float-aware for floats, zstd otherwise, cheaper when storage outruns compression), zstd, lz4, none, or float-bf16|f16|f32|f64")
	fs.Var(&o.ChunkSize, "chunk-size", "raw bytes per chunk")
	fs.IntVar(&o.Workers, "workers", 0, "chunks compressed at once (default: number of CPUs)")
	fs.IntVar(&o.Drains, "drains", staging.DefaultDrains, "shards drained at once")
	fs.Var(&o.HotBytes, "hot-bytes", "memory for the hot tier: the local ranks' shards of each job's newest --hot-steps steps, kept after they drain so that restoring them reads no storage (0: off)")
	fs.IntVar(&o.HotSteps, "hot-steps", tiers.DefaultHotSteps, "steps per job the hot tier keeps")
	fs.DurationVar(&o.PersistInterval, "persist-interval", 0, "drain a step to storage whenever this long has passed since the last one drained (e.g. 10m; with --persist-every, a step either picks is drained); the others stay in the hot tier and on the peers only (needs --hot-bytes)")
	fs.IntVar(&o.PersistEvery, "persist-every", 1, "drain only the steps this number divides to storage; the others stay in the hot tier and on the peers only (needs --hot-bytes; the same on every sidecar of a job)")
	fs.IntVar(&o.Restores, "restores", staging.DefaultRestores, "restores reading from storage at once (more wait their turn); bounds the memory restores take")
	fs.BoolVar(&o.PrintMemory, "print-memory", false, "print the memory these flags need (the arena, the heap's ceiling, their sum; JSON) and exit without starting: size a container's memory limit with it")
	fs.StringVar(&o.MetricsAddr, "metrics-addr", "", "serve Prometheus /metrics on this address, e.g. 127.0.0.1:9464")
	fs.DurationVar(&o.Grace, "shutdown-grace", time.Minute, "on SIGTERM, how long to keep draining before leaving saves journaled for the next start")
	fs.DurationVar(&o.DrainDelay, "debug-drain-delay", 0, "delay every drain (for crash tests)")
	_ = fs.MarkHidden("debug-drain-delay")
	fs.Var(&o.CacheBytes, "cache-bytes", "dataset shard cache budget, shared by every rank on the node (0 disables it)")
	fs.IntVar(&o.Nice, "nice", 10, "run the daemon this many nice levels (0-19) below the priority it starts with, so that the trainer beside it wins a contended core; 0 keeps it. It orders the daemon against processes of its own cgroup only: give a sidecar container a small CPU request instead")
	fs.BoolVar(&o.CacheLookahead, "cache-lookahead", true, "when the cache is full, evict the shard the open sessions read farthest in the future (false: keep what the cache holds)")
	fs.IntVar(&o.RingSlots, "ring-slots", prefetch.DefaultSlots, "batches each dataset session delivers ahead of the trainer")
	fs.IntVar(&o.RingSlotsMax, "ring-slots-max", 0, "slots a session's ring may grow to when its trainer catches up with a full ring, in room of --dataset-arena-bytes that leaves a whole ring free (default 2 x --ring-slots; --ring-slots: never grow)")
	fs.Var(&o.SlotBytes, "slot-bytes", "size of a ring slot in the arena (a larger batch gets a region of its own)")
	fs.StringSliceVar(&o.DatasetAllow, "dataset-allow", nil, "folders and s3://bucket/prefix sources trainers may read datasets from (repeat or comma-separate; none: datasets are off); the checkpoint store is not implied")
	fs.Var(&o.ReadAhead, "read-ahead-bytes", "memory each dataset session may hold: shards read ahead, its shuffle window (bounded by half of it), batches being assembled")
	fs.Var(&o.ListBytes, "dataset-list-bytes", "memory a dataset session's listing may take, about 512 bytes and twice the name per shard: a larger dataset fails to open")
	fs.Var(&o.DatasetArena, "dataset-arena-bytes", "the datasets' share of the arena, for ring slots and oversized batches (default: half of --staging-bytes; the rest stays for saves)")
	inGroup(fs, "storage", "storage", "job", "s3-endpoint", "s3-region", "s3-retry-deadline", "s3-stall-timeout", "file-mode",
		"codec", "chunk-size", "workers", "drains")
	inGroup(fs, "staging", "staging-bytes", "staging-wait", "tensor-table-bytes", "lease-timeout", "crash-fence", "restores",
		"arena-dir", "restart-wait")
	inGroup(fs, "tiers", "hot-bytes", "hot-steps", "persist-every", "persist-interval")
	inGroup(fs, "peers", "peers", "peers-file", "peers-dns", "peer-listen", "peer-advertise", "replicas", "peer-cert", "peer-key",
		"peer-ca", "peer-insecure")
	inGroup(fs, "datasets", "dataset-allow", "dataset-arena-bytes", "cache-bytes", "cache-lookahead", "ring-slots", "ring-slots-max",
		"slot-bytes", "read-ahead-bytes", "dataset-list-bytes")
	inGroup(fs, "security", "socket", "socket-group")
	inGroup(fs, "operations", "metrics-addr", "shutdown-grace", "nice", "print-memory")
	cmd.SetUsageFunc(groupedUsage)
	return cmd
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

// runServe checks everything that can fail cheaply (flags, the socket's
// folder, a daemon already on the socket, storage) before it allocates the
// arena, and takes back every step if a later one fails: the arena (what
// it created of it, and only while its journal is empty), the listener and
// the socket file, the socket folder it made.
func runServe(ctx context.Context, o *serveOptions, out io.Writer) error {
	log := slog.Default()
	c, gid, err := o.check()
	if err != nil {
		return usageError{err}
	}
	if o.PrintMemory {
		return printMemory(o, out)
	}
	// First, so that every report of a problem comes with the version
	// that had it.
	log.Info("ckptd starting", "version", Version(), "pid", os.Getpid())
	if nice, err := lowerPriority(o.Nice); err != nil {
		log.Warn("could not lower the daemon's CPU priority (--nice)", "err", err)
	} else {
		log.Info("cpu priority", "nice", nice)
	}
	peerClient, peerCreds, err := o.peerOptions.setup(ctx, int64(o.HotBytes), log)
	if err != nil {
		return usageError{err}
	}
	var replicas tiers.Peers // nil unless configured: a nil *peers.Client is not
	if peerClient != nil {
		replicas = peerClient
		defer peerClient.Close()
	}
	var undo undoStack
	fail := func(err error) error {
		undo.run()
		return err
	}
	sp, err := prepareSocket(o.Socket, gid, log)
	if err != nil {
		return err
	}
	undo.push(sp.undo)
	if err := waitSocketFree(ctx, sp.path, o.RestartWait, log); err != nil {
		return fail(err)
	}
	b, err := o.open(ctx, true)
	if err == nil {
		undo.push(func() { b.Close() })
		err = fault("storage")
	}
	if err != nil {
		return fail(err)
	}
	a, place, err := openArena(o, sp, arena.Options{
		Size: int64(o.StagingBytes), Lock: true, Logger: log,
		Shared: gid >= 0, SharedGID: gid, LockWait: o.RestartWait, Fence: o.ReuseFence,
	}, log)
	if err == nil {
		undo.push(func() { _ = a.Discard() })
		err = place.writePointer() // before any save is journaled, so that a restart finds them
	}
	if err == nil {
		undo.push(place.undoPointer)
		err = fault("arena")
	}
	if err != nil {
		return fail(err)
	}
	o.Workers = reserveIOProc(o.Workers)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	berrs := newBackendErrors(reg, backendStore, backendDataset)
	b = berrs.countStore(b, backendStore)
	if replicas != nil {
		replicas = berrs.countPeers(replicas)
	}
	mgr, err := staging.NewManager(server.CheckpointArena(a), b, staging.ManagerConfig{
		DefaultJob: o.Job, StagingWait: o.StagingWait, LeaseTimeout: o.LeaseTimeout, TableBudget: int64(o.TableBytes), ReuseFence: o.ReuseFence,
		Drains: o.Drains, Restores: o.Restores, Tiers: tiers.Config{HotBytes: int64(o.HotBytes), HotSteps: o.HotSteps, PersistEvery: o.PersistEvery, PersistInterval: o.PersistInterval, Peers: replicas}, DrainDelay: o.DrainDelay, Logger: log, Metrics: staging.NewMetrics(reg),
		Writer: checkpoint.WriterOptions{ChunkSize: int64(o.ChunkSize), Codec: c, Workers: o.Workers},
	})
	if err == nil {
		undo.push(func() {
			stopNow, cancel := context.WithCancel(context.Background())
			cancel() // recovered saves stay journaled
			mgr.Close(stopNow)
		})
		err = fault("manager")
	}
	if err != nil {
		return fail(err)
	}
	stopPeers := func() {}
	if peerClient != nil {
		addr, stop, perr := peers.Listen(o.peerOptions.Listen, peerCreds, peers.NewServer(mgr.PeerSide(), int64(o.HotBytes)))
		if perr != nil {
			return fail(perr)
		}
		undo.push(stop)
		stopPeers = stop
		list, self := peerClient.Members()
		log.Info("peers: serving replicas", "listen", addr, "peers", list, "self", self, "replicas", o.Replicas, "tls", peerCreds.Protocol())
		if o.discovery.Enabled() {
			wctx, stopWatch := context.WithCancel(ctx)
			defer stopWatch()
			go peerClient.Watch(wctx, o.discovery, log) // stopped when serve returns
		}
	}
	pcfg := o.prefetchConfig()
	pcfg.Logger, pcfg.Metrics = log, prefetch.NewMetrics(reg)
	pcfg.WrapSource = func(b storage.Backend) storage.Backend { return berrs.countStore(b, backendDataset) }
	pcfg.Open = func(ctx context.Context, url string) (storage.Backend, error) {
		b, err := openStorage(ctx, url, &o.storageOptions, false)
		return b, berrs.countOpen(backendDataset, err)
	}
	pf, err := prefetch.NewService(server.PrefetchArena(a), pcfg)
	if err == nil {
		undo.push(pf.Close)
		setMemoryLimit(memoryCeiling(o, pf.MemoryCeiling()), log)
		err = fault("prefetch")
	}
	if err != nil {
		return fail(err)
	}
	lis, err := listenUnix(sp.path, gid)
	if err == nil {
		undo.push(func() { lis.Close() })
		err = fault("listen")
	}
	if err != nil {
		return fail(err)
	}
	srv := grpc.NewServer(append(server.Interceptors(), serverOptions()...)...)
	server.Register(srv, mgr, a)
	server.RegisterPrefetch(srv, pf, a)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	ready := newReadiness(b, o.Job, hs, log)
	server.RegisterDaemon(srv, mgr, pf, server.StatusConfig{Version: Version(), Started: time.Now(), Storage: ready.check, BackendErrors: berrs.Counts})
	readyCtx, stopReady := context.WithCancel(context.Background())
	defer stopReady()
	go ready.run(readyCtx)
	stopMetrics := serveMetrics(o.MetricsAddr, reg, ready)
	log.Info("ckptd serving", "version", Version(), "socket", sp.path, "storage", b.Location(), "job", o.Job,
		"arena", a.Path(), "staging_bytes", a.Size(), "locked", a.Locked(), "codec", c)
	errc := make(chan error, 1)
	go func() {
		errc <- srv.Serve(peercred.NewListener(lis.(peercred.UnixListener), peercred.Policy{UID: os.Geteuid(), GID: gid}, nil, log))
	}()
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
	stopPeers()
	pf.Close()
	removed, err := shutdown(mgr, a, o.Grace, err)
	if removed {
		place.removePointer()
	}
	b.Close()
	return err
}

// check validates the flags that need no storage, socket or arena, and
// returns the codec setting and the --socket-group gid (-1 for none).
func (o *serveOptions) check() (codec.Codec, int, error) {
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
	if o.StagingBytes < 4096 {
		return "", 0, fmt.Errorf("--staging-bytes %d is less than one 4096-byte page", o.StagingBytes)
	}
	// The writer's own checks (--chunk-size) without storage: it touches
	// its backend only when it drains.
	if _, err := checkpoint.NewWriter(nil, checkpoint.WriterOptions{ChunkSize: int64(o.ChunkSize), Codec: c, Workers: 1}); err != nil {
		return "", 0, fmt.Errorf("--chunk-size: %w", err)
	}
	return c, gid, nil
}

// serverOptions bound what one client connection can hold in the daemon.
func serverOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		// A request is buffered whole before its handler runs. Tensor bytes
		// travel through the arena; 16 MiB is ample for a tensor table or
		// one message of a stream.
		grpc.MaxRecvMsgSize(pb.MaxMessageBytes),
		// Each stream is a goroutine and up to one buffered request, so this
		// bounds one connection at 128 x 16 MiB. A trainer's saves, waits
		// and dataset sessions need far fewer at once; a client past the
		// limit queues, it does not fail.
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
