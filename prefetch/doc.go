// Package prefetch will hold ckptd's dataset prefetcher: sources (POSIX and
// S3 through the storage backends), a deterministic per-epoch order over
// (seed, epoch, world_size, rank), read-ahead bounded by bytes in flight, a
// byte-budgeted in-memory cache shared by the node's ranks, and delivery of
// batches through a ring of slots in the shared-memory staging arena.
//
// Nothing is implemented yet; the package exists so that the top-level
// layout of DESIGN.md holds. It will depend only on storage and
// internal/arena, never on gRPC.
package prefetch
