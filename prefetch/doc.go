// Package prefetch is ckptd's dataset prefetcher: it lists a dataset's
// shards (a POSIX folder or an S3 prefix, through storage.Backend), orders
// them deterministically per (seed, epoch, world_size, rank), reads them
// ahead of the trainer with bounded bytes in flight, keeps them in a
// byte-budgeted cache shared by every rank on the node, and cuts them into
// samples and batches.
//
// # Order
//
// The order is a pure function of (seed, epoch, world_size, rank): the
// epoch's shard order is a permutation seeded by (seed, epoch); rank r takes
// the shards at positions r, r+world_size, ... of it, so every sample is
// delivered exactly once per epoch across the ranks; samples are shuffled
// within a window of ShuffleWindow samples by a generator seeded by (seed,
// epoch, rank). Resuming at (epoch, start) replays the same sequence and
// drops its first start samples, so a data position of two integers fits
// in checkpoint metadata.
//
// # Formats
//
// WebDataset: shards are .tar files; a sample is a run of consecutive
// members sharing a key (the member path up to the first dot of its base
// name), with one field per extension (the rest of the base name). Raw:
// every object is one sample, its key the object name without extension
// and its one field named by the extension ("bin" when it has none).
//
// # Cache
//
// Shards are cached whole in a ristretto cache with a byte budget. A
// dataset that fits is read from storage once. For one that does not, a
// full cache keeps what it holds while that is being read: epoch scans
// read every shard once per epoch, so a frequency sketch (ristretto's
// TinyLFU) sees them all alike and admitting each miss would evict a
// random shard, often one about to be read (and LRU would evict each shard
// just before it is needed again). Keeping the subset that fits hits
// budget/dataset of the reads from the second epoch on, the most any
// policy can. The shards of a dataset (a source's backend and prefix)
// nobody has read for DefaultStaleAfter give way to new ones. Each shard is filled under a per-key lock, so ranks asking for
// the same shard at once read it from storage once.
//
// This package knows nothing of gRPC or of the shared-memory ring that
// delivers batches; the daemon's server does that.
package prefetch
