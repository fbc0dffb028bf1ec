package main

import (
	"log/slog"
	"os"
	"runtime/debug"
)

// memoryHeadroom is what the daemon needs beyond its configured budgets:
// the Go runtime, gRPC's buffers and the requests being received.
const memoryHeadroom = 256 << 20

// memoryCeiling is what the daemon's heap may hold whatever clients send
// (docs/architecture.md, "Memory"): open tensor tables, the drain's chunk
// buffers, S3 parts in flight (the most a store may take), the dataset
// service, and headroom. The arena is shared memory, counted apart.
func memoryCeiling(o *serveOptions, prefetchCeiling int64) int64 {
	drainBuffers := 4 * int64(o.Workers) * 2 * int64(o.ChunkSize)
	s3Parts := int64(o.Drains) * 8 * (16 << 20)
	return int64(o.TableBytes) + drainBuffers + s3Parts + prefetchCeiling + memoryHeadroom
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
