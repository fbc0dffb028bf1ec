package main

import (
	"context"
	"io"
	"io/fs"
	"log/slog"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/internal/daemon"
	"github.com/ckptd/ckptd/prefetch"
	"github.com/ckptd/ckptd/storage/storageurl"
)

func newServeCmd() *cobra.Command {
	o := &daemon.Options{StagingBytes: 1 << 30, ChunkSize: checkpoint.DefaultChunkSize, CacheBytes: 1 << 30,
		SlotBytes: prefetch.DefaultSlotBytes, TableBytes: staging.DefaultTableBudget,
		ReadAhead: prefetch.DefaultReadAheadBytes, ListBytes: prefetch.DefaultListBytes}
	var so storageOptions
	var printMemory bool
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the sidecar: accept saves over a unix socket, drain them to storage, and serve datasets",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runServe(cmd.Context(), o, &so, printMemory, cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	so.register(fs)
	registerPeerFlags(fs, &o.Peers)
	fs.StringVar(&o.Socket, "socket", "", "unix socket to listen on (default $CKPTD_SOCKET, else $XDG_RUNTIME_DIR/ckptd.sock, else /tmp/ckptd-<uid>/ckptd.sock)")
	fs.StringVar(&o.SocketGroup, "socket-group", "", "group (name or gid) whose members may use the socket and map the arena, besides its owner; their copies into the arena are then hashed and checked (docs/security.md)")
	fs.StringVar(&o.ArenaDir, "arena-dir", "", "shared-memory folder of the staging arena (default /dev/shm/ckptd-<uid>-<hash of socket path>, or a fresh name recorded next to the socket if another user holds that one)")
	fs.DurationVar(&o.StorageWait, "storage-wait", 15*time.Second, "how long the start waits for the checkpoint store to answer before failing, saying so (0: as long as --s3-retry-deadline, for a store that comes up after the daemon)")
	fs.DurationVar(&o.RestartWait, "restart-wait", 30*time.Second, "how long to wait for a previous daemon that is exiting (killed a moment ago: unmapping a large arena takes seconds) to release the socket and the arena; a running one fails the start at once")
	fs.Var((*byteSize)(&o.StagingBytes), "staging-bytes", "size of the shared-memory staging arena (e.g. 8GiB)")
	fs.DurationVar(&o.StagingWait, "staging-wait", staging.DefaultStagingWait, "how long a save waits for arena space before failing")
	fs.StringVar(&o.SpillDir, "spill-dir", "", "a local-disk folder that saves waiting to drain move to when the arena has no room for a new one (storage does not take bytes, or not as fast as saves come), so that new saves are still accepted (journaled and fsynced there; drained first when storage is back)")
	fs.Var((*byteSize)(&o.SpillBytes), "spill-bytes", "the most --spill-dir may hold (0: what the disk takes)")
	fs.DurationVar(&o.ReuseFence, "crash-fence", staging.DefaultReuseFence, "after a crash, how long the save regions the dead daemon's clients may still be copying into stay unused (the rest of the arena is free at once); also how long a gone client's save region is kept when its process cannot be seen")
	fs.DurationVar(&o.LeaseTimeout, "lease-timeout", staging.DefaultLeaseTimeout, "end saves never committed and restores never released after this (a client that disconnects frees them at once)")
	fs.Var((*byteSize)(&o.TableBytes), "tensor-table-bytes", "memory for the tensor tables and metadata of open saves, and 1 KiB per open restore; a save or restore that would exceed it fails with RESOURCE_EXHAUSTED")
	fs.StringVar(&o.Codec, "codec", string(codec.Auto), "chunk codec: auto (per chunk by dtype: float-aware for floats, zstd otherwise, cheaper when storage outruns compression), zstd, lz4, none, or float-bf16|f16|f32|f64")
	fs.Var((*byteSize)(&o.ChunkSize), "chunk-size", "raw bytes per chunk")
	fs.IntVar(&o.Workers, "workers", 0, "chunks compressed at once (default: number of CPUs)")
	fs.IntVar(&o.Drains, "drains", staging.DefaultDrains, "shards drained at once")
	fs.BoolVar(&o.SpreadData, "spread-data", false, "write each rank's data under one of 256 prefixes by a hash of the rank (steps/spread-<hh>/...), not its step's folder: for S3's request rate per prefix at thousands of ranks (docs/scale.md); readers need nothing, and a ckptd older than this one's prune would leave such data behind")
	fs.BoolVar(&o.Incremental, "incremental", false, "reference, instead of writing again, each chunk whose bytes the rank held in the job's newest committed step (a fine-tune's frozen weights): a 128-bit content key per chunk and a few small requests per save; prune keeps what kept steps reference (docs/checkpoints.md); a ckptd older than this one cannot read such steps")
	fs.Var((*byteSize)(&o.HotBytes), "hot-bytes", "memory for the hot tier: the local ranks' shards of each job's newest --hot-steps steps, kept after they drain so that restoring them reads no storage (0: off)")
	fs.IntVar(&o.HotSteps, "hot-steps", tiers.DefaultHotSteps, "steps per job the hot tier keeps")
	fs.DurationVar(&o.PersistInterval, "persist-interval", 0, "drain a step to storage whenever this long has passed since the last one drained (e.g. 10m; with --persist-every, a step either picks is drained); the others stay in the hot tier and on the peers only (needs --hot-bytes)")
	fs.IntVar(&o.PersistEvery, "persist-every", 1, "drain only the steps this number divides to storage; the others stay in the hot tier and on the peers only (needs --hot-bytes; the same on every sidecar of a job)")
	fs.IntVar(&o.Restores, "restores", staging.DefaultRestores, "restores reading from storage at once (more wait their turn); bounds the memory restores take")
	fs.BoolVar(&printMemory, "print-memory", false, "print the memory these flags need (the arena, the heap's ceiling, their sum; JSON) and exit without starting: size a container's memory limit with it")
	fs.StringVar(&o.MetricsAddr, "metrics-addr", "", "serve Prometheus /metrics on this address, e.g. 127.0.0.1:9464")
	fs.DurationVar(&o.Grace, "shutdown-grace", time.Minute, "on SIGTERM, how long to keep draining before leaving saves journaled for the next start")
	fs.DurationVar(&o.DrainDelay, "debug-drain-delay", 0, "delay every drain (for crash tests)")
	_ = fs.MarkHidden("debug-drain-delay")
	fs.Var((*byteSize)(&o.StallWritesAfter), "debug-stall-writes-after", "stall every checkpoint object's write after this many bytes, for an hour (for crash tests: a kill in the middle of a write)")
	_ = fs.MarkHidden("debug-stall-writes-after")
	fs.Var((*byteSize)(&o.CacheBytes), "cache-bytes", "dataset shard cache budget, shared by every rank on the node (0 disables it)")
	fs.BoolVar(&o.CacheAtStart, "cache-memory-at-start", true, "with an s3:// source allowed, take the memory of shards read from S3 (--cache-bytes + --read-ahead-bytes; none with --cache-bytes 0) at start, in the background until the first dataset is opened, so that a first epoch does not take it page by page (folders' shards are mapped and need none)")
	fs.IntVar(&o.Nice, "nice", 10, "run the daemon this many nice levels (0-19) below the priority it starts with, so that the trainer beside it wins a contended core; 0 keeps it. It orders the daemon against processes of its own cgroup only: give a sidecar container a small CPU request instead")
	fs.StringVar(&o.DiskCacheDir, "disk-cache-dir", "", "a folder on a local disk (NVMe) that keeps the shards read from S3 sources, so a dataset larger than memory is read from the store once per node; a file cut or damaged there is read from the store again; needs --disk-cache-bytes")
	fs.Var((*byteSize)(&o.DiskCacheBytes), "disk-cache-bytes", "what --disk-cache-dir may hold (required with it); when full it drops the shard the open sessions read farthest in the future")
	fs.BoolVar(&o.CacheLookahead, "cache-lookahead", true, "when the cache is full, evict the shard the open sessions read farthest in the future (false: keep what the cache holds)")
	fs.IntVar(&o.RingSlots, "ring-slots", prefetch.DefaultSlots, "batches each dataset session delivers ahead of the trainer")
	fs.IntVar(&o.RingSlotsMax, "ring-slots-max", 0, "slots a session's ring may grow to when its trainer catches up with a full ring, in room of --dataset-arena-bytes that leaves a whole ring free (default 2 x --ring-slots; --ring-slots: never grow)")
	fs.Var((*byteSize)(&o.SlotBytes), "slot-bytes", "size of a ring slot in the arena (a larger batch gets a region of its own)")
	fs.StringSliceVar(&o.DatasetAllow, "dataset-allow", nil, "folders and s3://bucket/prefix sources trainers may read datasets from (repeat or comma-separate; none: datasets are off); the checkpoint store is not implied")
	fs.Var((*byteSize)(&o.ReadAhead), "read-ahead-bytes", "memory each dataset session may hold: shards read ahead, its shuffle window (bounded by half of it), batches being assembled")
	fs.Var((*byteSize)(&o.ListBytes), "dataset-list-bytes", "memory a dataset session's listing may take, about 512 bytes and twice the name per shard: a larger dataset fails to open")
	fs.Var(datasetShare{&o.DatasetArena, &o.DatasetsOff}, "dataset-arena-bytes", "the datasets' share of the arena, for ring slots and oversized batches (default: half of --staging-bytes; the rest stays for saves); 0 turns datasets off")
	inGroup(fs, "storage", "storage", "job", "s3-endpoint", "s3-region", "s3-retry-deadline", "s3-stall-timeout", "file-mode", "storage-wait",
		"codec", "chunk-size", "workers", "drains", "spread-data", "incremental")
	inGroup(fs, "staging", "staging-bytes", "staging-wait", "tensor-table-bytes", "lease-timeout", "crash-fence", "restores",
		"arena-dir", "restart-wait", "spill-dir", "spill-bytes")
	inGroup(fs, "tiers", "hot-bytes", "hot-steps", "persist-every", "persist-interval")
	inGroup(fs, "peers", "peers", "peers-file", "peers-dns", "peer-listen", "peer-advertise", "replicas", "peer-cert", "peer-key",
		"peer-ca", "peer-server-name", "peer-insecure", "peer-insecure-network", "peer-require")
	inGroup(fs, "datasets", "dataset-allow", "dataset-arena-bytes", "cache-bytes", "cache-memory-at-start", "cache-lookahead", "disk-cache-dir", "disk-cache-bytes", "ring-slots", "ring-slots-max",
		"slot-bytes", "read-ahead-bytes", "dataset-list-bytes")
	inGroup(fs, "security", "socket", "socket-group")
	inGroup(fs, "operations", "metrics-addr", "shutdown-grace", "nice", "print-memory")
	cmd.SetUsageFunc(groupedUsage)
	return cmd
}

// registerPeerFlags adds serve's flags for replicas on peer sidecars.
func registerPeerFlags(fs *pflag.FlagSet, p *daemon.PeerOptions) {
	fs.StringSliceVar(&p.Peers, "peers", nil, "the job's sidecars, host:port each (the same list on every node, this one included): each drained shard is sent to --replicas of them, chosen from its rank, and a restore asks them before storage; needs --hot-bytes")
	fs.StringVar(&p.PeersFile, "peers-file", "", "instead of --peers: a file listing the job's sidecars, host:port per line, read again every 10s")
	fs.StringVar(&p.PeersDNS, "peers-dns", "", "instead of --peers: name:port, a DNS name resolving to every sidecar of the job (a Kubernetes headless service), looked up again every 10s")
	fs.StringVar(&p.Listen, "peer-listen", "", "TCP address for the peers' service (e.g. :7465)")
	fs.StringVar(&p.Advertise, "peer-advertise", "", "this sidecar's entry in --peers (default --peer-listen)")
	fs.IntVar(&p.Replicas, "replicas", 1, "peers that keep a copy of each shard")
	fs.StringVar(&p.TLS.CertFile, "peer-cert", "", "this sidecar's certificate (PEM) for the peers' mutual TLS")
	fs.StringVar(&p.TLS.KeyFile, "peer-key", "", "its private key (PEM)")
	fs.StringVar(&p.TLS.CAFile, "peer-ca", "", "the CA (PEM) that signs every peer's certificate; others are refused")
	fs.StringVar(&p.TLS.ServerName, "peer-server-name", "", "the name every peer's certificate carries, checked instead of the address dialled (peers found by --peers-dns are dialled by IP, which no certificate made in advance names)")
	fs.BoolVar(&p.TLS.Insecure, "peer-insecure", false, "send checkpoints to peers in plaintext, without TLS: anyone who reaches the peer port reads and writes replicas (loopback only, unless --peer-insecure-network)")
	fs.BoolVar(&p.Require, "peer-require", false, "at start, wait (up to 2m) until every listed peer answers and accepts this sidecar's certificate, and fail to start otherwise (without it: a warning in the log)")
	fs.BoolVar(&p.InsecureNetwork, "peer-insecure-network", false, "let --peer-insecure listen and reach peers off loopback, where anyone on the network reads and writes replicas")
}

// runServe runs the daemon (internal/daemon) on the flags, or prints the
// memory they need.
func runServe(ctx context.Context, o *daemon.Options, so *storageOptions, printMemory bool, out io.Writer) error {
	o.URL, o.Job, o.Version = so.URL, so.Job, Version()
	o.Storage = storageurl.OpenOptions{S3Endpoint: so.S3Endpoint, S3Region: so.S3Region, S3RetryDeadline: so.S3Retry,
		S3StallTimeout: so.S3Stall, FileMode: fs.FileMode(so.FileMode), Logger: slog.Default()}
	if printMemory {
		return daemon.PrintMemory(o, out)
	}
	return daemon.Run(ctx, o)
}

// datasetShare is --dataset-arena-bytes: a size, 0 turning datasets off;
// left unset, the daemon gives them half the arena.
type datasetShare struct {
	bytes *int64
	off   *bool
}

func (d datasetShare) String() string {
	if d.bytes == nil || *d.bytes == 0 && !*d.off {
		return "" // unset: help shows the default in words
	}
	return formatBytes(*d.bytes)
}

func (d datasetShare) Type() string { return "bytes" }

func (d datasetShare) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*d.bytes, *d.off = n, n == 0
	return nil
}
