package daemon

import (
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"

	"github.com/ckptd/ckptd/internal/server"
	"github.com/ckptd/ckptd/prefetch"
)

// memoryHeadroom is what the daemon needs beyond its configured budgets
// and what its socket takes in (server.IntakeLimits): the Go runtime and
// the peers' gRPC buffers.
const memoryHeadroom = 256 << 20

// memoryCeiling is what the daemon's heap may hold whatever clients send
// (docs/architecture.md, "Memory"): open tensor tables, the drain's chunk
// buffers, S3 parts in flight (the most a store may take), the dataset
// service, restores (chunk buffers and a manifest each), and headroom. The
// arena is shared memory, counted apart.
func memoryCeiling(o *Options, prefetchCeiling int64) int64 {
	drainBuffers := 4 * int64(o.Workers) * 2 * int64(o.ChunkSize)
	s3Parts := int64(o.Drains) * 8 * (16 << 20)
	restores := int64(o.Restores) * (restoreReads*2*int64(o.ChunkSize) + restoreManifest)
	var hot int64
	if !o.hotFile() {
		hot = int64(o.HotBytes)
	}
	if len(o.Peers.Peers) > 0 || o.Peers.PeersFile != "" || o.Peers.PeersDNS != "" {
		// A shard being fetched from a peer for a restore, up to
		// --hot-bytes; replicas being received count inside the hot tier.
		hot += int64(o.HotBytes)
	}
	return int64(o.TableBytes) + drainBuffers + s3Parts + restores + hot + prefetchCeiling + server.DefaultIntake.Bytes() + memoryHeadroom
}

// hotFile reports whether the hot tier keeps its shards in a shared-memory
// file beside the arena (see Daemon.openHot), not in the heap.
func (o *Options) hotFile() bool { return o.HotBytes > 0 && o.SocketGroup == "" }

// restoreReads is checkpoint.ReadOptions.Concurrency's default, the
// chunks one restore holds at once; restoreManifest is what a typical
// manifest and tensor table take parsed (one of the largest tables a save
// may have: 262,144 tensors).
const (
	restoreReads    = 8
	restoreManifest = 64 << 20
)

// prefetchConfig is the dataset service's configuration from the flags.
func (o *Options) prefetchConfig() prefetch.ServiceConfig {
	return prefetch.ServiceConfig{
		CacheBytes: int64(o.CacheBytes), CacheAtStart: o.CacheAtStart, NoLookahead: !o.CacheLookahead, Slots: o.RingSlots, MaxSlots: o.RingSlotsMax, SlotBytes: int64(o.SlotBytes), AllocWait: o.StagingWait,
		ArenaBytes: int64(o.DatasetArena), Allow: o.DatasetAllow, Off: o.DatasetsOff,
		DiskCacheDir: o.DiskCacheDir, DiskCacheBytes: o.DiskCacheBytes,
		Options: prefetch.Options{ReadAheadBytes: int64(o.ReadAhead), ListBytes: int64(o.ListBytes)},
	}
}

// memoryNeeds is what `ckptd serve --print-memory` prints.
type memoryNeeds struct {
	ArenaBytes   int64 `json:"arena_bytes"`        // shared memory: size /dev/shm for it
	HotBytes     int64 `json:"hot_file_bytes"`     // shared memory too, beside the arena: the hot tier (0: none, or in the heap)
	HeapCeiling  int64 `json:"heap_ceiling_bytes"` // the daemon's heap, whatever clients send
	TotalBytes   int64 `json:"total_bytes"`        // what a container's memory limit must cover
	Workers      int   `json:"workers"`            // the --workers the ceiling assumes
	DatasetBytes int64 `json:"dataset_ceiling_bytes"`
	// SocketBytes is what the socket may hold of requests being received
	// (connections, calls, requests; see server.IntakeLimits), in the heap.
	SocketBytes int64 `json:"socket_receive_bytes"`
}

// PrintMemory checks the options and prints the memory they need,
// opening nothing. The arena's pages are charged to the daemon's
// container, which touches them first, so its limit covers both.
func PrintMemory(o *Options, out io.Writer) error {
	if _, _, err := o.check(); err != nil {
		return UsageError{err}
	}
	if o.Workers <= 0 {
		o.Workers = runtime.GOMAXPROCS(0) // what serve would use here: pass --workers for another machine
	}
	ds := o.prefetchConfig().MemoryCeiling(int64(o.StagingBytes))
	heap := memoryCeiling(o, ds)
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	var hot int64
	if o.hotFile() {
		hot = int64(o.HotBytes)
	}
	return enc.Encode(memoryNeeds{ArenaBytes: int64(o.StagingBytes), HotBytes: hot, HeapCeiling: heap,
		TotalBytes: int64(o.StagingBytes) + hot + heap, Workers: o.Workers, DatasetBytes: ds, SocketBytes: server.DefaultIntake.Bytes()})
}

// setMemoryLimit makes the garbage collector keep the heap under the
// daemon's ceiling (a soft limit: it collects harder as the heap nears
// it), so that garbage does not push a sidecar's memory past what its
// budgets promise. GOMEMLIMIT, when set, wins.
func setMemoryLimit(limit int64, log *slog.Logger) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	debug.SetMemoryLimit(limit)
	log.Info("memory ceiling of the daemon's heap, besides the arena", "bytes", limit)
}

// lowerMemoryLimit sets the heap's soft limit to the ceiling less the
// dataset shard memory held outside the heap (prefetch's shard buffers,
// which the ceiling counts but the garbage collector does not see), so
// that heap and buffers together stay under it.
func lowerMemoryLimit(ceiling, offHeap int64) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	debug.SetMemoryLimit(max(ceiling-offHeap, ceiling/4))
}
