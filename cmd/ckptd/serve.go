package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/codec"
	"github.com/ckptd/ckptd/internal/metrics"
	"github.com/ckptd/ckptd/internal/server"
	"github.com/ckptd/ckptd/prefetch"
	"github.com/ckptd/ckptd/storage"
)

type serveOptions struct {
	storageOptions
	Socket       string
	SocketGroup  string
	ArenaDir     string
	StagingBytes byteSize
	StagingWait  time.Duration
	LeaseTimeout time.Duration
	Codec        string
	ChunkSize    byteSize
	Workers      int
	Drains       int
	MetricsAddr  string
	Grace        time.Duration
	DrainDelay   time.Duration
	CacheBytes   byteSize
	RingSlots    int
	SlotBytes    byteSize
	DatasetArena byteSize
	DatasetAllow []string
	ReadAhead    byteSize
}

// DefaultSocket is where serve listens and clients connect when neither
// --socket nor CKPTD_SOCKET is given. The Python client uses the same rule.
func DefaultSocket() string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("ckptd-%d.sock", os.Getuid()))
}

func newServeCmd() *cobra.Command {
	o := &serveOptions{StagingBytes: 1 << 30, ChunkSize: 4 << 20, CacheBytes: 1 << 30, SlotBytes: 16 << 20}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the sidecar: accept saves over a unix socket, drain them to storage, and serve datasets",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runServe(cmd.Context(), o) },
	}
	fs := cmd.Flags()
	o.storageOptions.register(fs)
	fs.StringVar(&o.Socket, "socket", DefaultSocket(), "unix socket to listen on")
	fs.StringVar(&o.SocketGroup, "socket-group", "", "group (name or gid) whose members may use the socket and map the arena, besides its owner")
	fs.StringVar(&o.ArenaDir, "arena-dir", "", "shared-memory folder of the staging arena (default /dev/shm/ckptd-<hash of socket path>)")
	fs.Var(&o.StagingBytes, "staging-bytes", "size of the shared-memory staging arena (e.g. 8GiB)")
	fs.DurationVar(&o.StagingWait, "staging-wait", 30*time.Second, "how long a save waits for arena space before failing")
	fs.DurationVar(&o.LeaseTimeout, "lease-timeout", 30*time.Minute, "reclaim regions of saves never committed and restores never released after this")
	fs.StringVar(&o.Codec, "codec", string(codec.Auto), "chunk codec: auto (per chunk by dtype: float-aware for floats, zstd otherwise, cheaper when storage outruns compression), zstd, lz4, none, or float-bf16|f16|f32|f64")
	fs.Var(&o.ChunkSize, "chunk-size", "raw bytes per chunk")
	fs.IntVar(&o.Workers, "workers", 0, "chunks compressed at once (default: number of CPUs)")
	fs.IntVar(&o.Drains, "drains", 2, "shards drained at once")
	fs.StringVar(&o.MetricsAddr, "metrics-addr", "", "serve Prometheus /metrics on this address, e.g. 127.0.0.1:9464")
	fs.DurationVar(&o.Grace, "shutdown-grace", time.Minute, "on SIGTERM, how long to keep draining before leaving saves journaled for the next start")
	fs.DurationVar(&o.DrainDelay, "debug-drain-delay", 0, "delay every drain (for crash tests)")
	_ = fs.MarkHidden("debug-drain-delay")
	fs.Var(&o.CacheBytes, "cache-bytes", "dataset shard cache budget, shared by every rank on the node (0 disables it)")
	fs.IntVar(&o.RingSlots, "ring-slots", 4, "batches each dataset session delivers ahead of the trainer")
	fs.Var(&o.SlotBytes, "slot-bytes", "size of a ring slot in the arena (a larger batch gets a region of its own)")
	fs.StringSliceVar(&o.DatasetAllow, "dataset-allow", nil, "folders and s3://bucket/prefix sources trainers may read datasets from (repeat or comma-separate; none: datasets are off); the checkpoint store is not implied")
	fs.Var(&o.ReadAhead, "read-ahead-bytes", "memory each dataset session may hold: shards read ahead, its shuffle window (bounded by half of it), batches being assembled (default 256MiB)")
	fs.Var(&o.DatasetArena, "dataset-arena-bytes", "the datasets' share of the arena, for ring slots and oversized batches (default: half of --staging-bytes; the rest stays for saves)")
	return cmd
}

func runServe(ctx context.Context, o *serveOptions) error {
	log := slog.Default()
	c, err := codec.ParseSetting(o.Codec)
	if err != nil {
		return usageError{err}
	}
	gid, err := lookupGID(o.SocketGroup)
	if err != nil {
		return usageError{err}
	}
	b, err := o.open(ctx, true)
	if err != nil {
		return err
	}
	defer b.Close()
	if o.ArenaDir == "" {
		o.ArenaDir = defaultArenaDir(o.Socket)
	}
	a, err := arena.Open(arena.Options{
		Dir: o.ArenaDir, Size: int64(o.StagingBytes), Lock: true, Logger: log,
		Shared: gid >= 0, SharedGID: gid,
	})
	if err != nil {
		return err
	}
	o.Workers = reserveIOProc(o.Workers)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mgr, err := checkpoint.NewManager(a, b, checkpoint.ManagerConfig{
		DefaultJob: o.Job, StagingWait: o.StagingWait, LeaseTimeout: o.LeaseTimeout,
		Drains: o.Drains, DrainDelay: o.DrainDelay, Logger: log, Metrics: metrics.NewCheckpoint(reg),
		Writer: checkpoint.WriterOptions{ChunkSize: int64(o.ChunkSize), Codec: c, Workers: o.Workers},
	})
	if err != nil {
		a.Close()
		return err
	}
	lis, err := listenUnix(o.Socket, gid)
	if err != nil {
		mgr.Close(ctx)
		a.Close()
		return err
	}
	pf, err := prefetch.NewService(a, prefetch.ServiceConfig{
		CacheBytes: int64(o.CacheBytes), Slots: o.RingSlots, SlotBytes: int64(o.SlotBytes), AllocWait: o.StagingWait,
		Logger: log, Metrics: metrics.NewPrefetch(reg), ArenaBytes: int64(o.DatasetArena), Allow: o.DatasetAllow,
		Options: prefetch.Options{ReadAheadBytes: int64(o.ReadAhead)},
		Open: func(ctx context.Context, url string) (storage.Backend, error) {
			return openStorage(ctx, url, &o.storageOptions, false)
		},
	})
	if err != nil {
		lis.Close()
		mgr.Close(ctx)
		a.Close()
		return err
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(16 << 20))
	server.Register(srv, mgr)
	server.RegisterPrefetch(srv, pf)
	stopMetrics := serveMetrics(o.MetricsAddr, reg)
	log.Info("ckptd serving", "socket", o.Socket, "storage", b.Location(), "job", o.Job,
		"arena", a.Path(), "staging_bytes", a.Size(), "locked", a.Locked(), "codec", c)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case <-ctx.Done():
		log.Info("shutting down: no new requests; draining staged saves", "grace", o.Grace)
	case err = <-errc:
		log.Error("grpc server stopped", "err", err)
	}
	stopMetrics()
	stopGRPC(srv, 5*time.Second)
	pf.Close()
	return shutdown(mgr, a, o.Grace, err)
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
// in the arena, which is kept for the next start only in that case.
func shutdown(mgr *checkpoint.Manager, a *arena.Arena, grace time.Duration, err error) error {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if left := mgr.Close(ctx); left > 0 {
		slog.Warn("saves left journaled; they drain when ckptd serve starts again with the same arena", "saves", left, "arena", a.Path())
		return errors.Join(err, a.Close())
	}
	return errors.Join(err, a.Remove())
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

// defaultArenaDir derives the arena folder from the socket path, so that
// several daemons on one machine (one per socket) get their own arenas and
// a restarted daemon finds its predecessor's.
func defaultArenaDir(socket string) string {
	abs, err := filepath.Abs(socket)
	if err != nil {
		abs = socket
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join("/dev/shm", "ckptd-"+hex.EncodeToString(sum[:6]))
}

// listenUnix listens on path, replacing a stale socket file left by a dead
// daemon but refusing to steal one that a live daemon answers on. Only the
// owner (and group gid, unless -1) may connect: that is the access control.
func listenUnix(path string, gid int) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("another ckptd is already serving on %s", path)
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	mode := os.FileMode(0o600)
	if gid >= 0 {
		if err := os.Chown(path, -1, gid); err != nil {
			lis.Close()
			return nil, fmt.Errorf("--socket-group: %w", err)
		}
		mode = 0o660
	}
	if err := os.Chmod(path, mode); err != nil {
		lis.Close()
		return nil, err
	}
	return lis, nil
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
func serveMetrics(addr string, reg *prometheus.Registry) func() {
	if addr == "" {
		return func() {}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	hs := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := hs.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Error("metrics server failed", "addr", addr, "err", err)
		}
	}()
	return func() { _ = hs.Close() }
}
