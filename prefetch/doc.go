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
// epoch, rank), or, with ShuffleBlock, in blocks of that many of the
// rank's shards, each read whole and then delivered permuted. Resuming at
// (epoch, start) replays the same sequence and drops its first start
// samples, so a data position of two integers fits in checkpoint
// metadata.
//
// Shards are dealt whole, so ranks get as many samples as their shards
// hold. Spec.Even evens that out (a job whose ranks step together, DDP,
// hangs at the epoch's end otherwise): with EvenPad (the default) every
// rank delivers as many samples as the rank with the most, the others
// repeating after their own the first samples of the epoch's shard order,
// in file order (Stats.Padded; never part of a Delivered position); with
// EvenDrop as many as the rank with the fewest, the others stopping early.
// That needs every rank's count, so every shard's: the samples of each
// shard dealt are counted in the background (countSamples reads a tar's
// member headers and skips what data it can, see skipReader; a raw object
// is one sample; a shard a session parses whole is counted for free),
// once per daemon for all its sessions (Cache.counts, within CountBytes). A
// padded rank waits for the counts only at its end; a dropping one
// delivers freely as far as every rank's counted shards reach. A world
// size of 1 counts nothing.
//
// The shuffle window is bounded by bytes too (see Memory): while it holds
// less than half the read-ahead budget, as a window of small samples
// does, the order is the plain count-bounded window's; beyond, samples
// leave the window early, chosen by the same generator. Sizes are part of
// the data, so the order is still a pure function of (seed, epoch,
// world_size, rank, shuffle window) and the data, given the daemon's
// --read-ahead-bytes: a resume replays it exactly, but a daemon with
// another --read-ahead-bytes may shuffle windows of large samples
// differently.
//
// # Mixtures
//
// OpenMixture reads several sources in one iteration (mixture.go): each
// shard carries its source (shardSource: backend, prefix, format), an
// epoch's order interleaves the sources' shares of the reads (an epochFunc
// in place of epochOrder), each source continuing its own epochs, and the
// rest (dealing, window, resume, even epochs, cache) is a single
// source's. A shard's ID (source:source-epoch/name) names it in positions.
//
// # Formats
//
// WebDataset: shards are .tar files; a sample is a run of consecutive
// members sharing a key (the member path up to the first dot of its base
// name), with one field per extension (the rest of the base name). Raw:
// every object is one sample, its key the object name without extension
// and its one field named by the extension ("bin" when it has none).
// Parquet (parquet.go): a shard is a row group, read as the bytes its
// column chunks span and rewritten (decodePQ) into a standalone file of
// uncompressed pages that parquet-go then reads, every size it trusts
// checked first; footers are read once per daemon (Cache.footers).
// MDS (mds.go): Mosaic streaming's index.json lists the shards, their
// sample counts, compression and hashes; a shard is read whole (hash
// checked, decompressed: decodeShard, in the cache's fill) or streamed
// (decompressed and hashed as it is parsed), and a sample's fields are
// its columns' bytes, its key its global index. Auto (also "") tells
// the format from the source: .tar objects, else an MDS index.json, else
// .parquet objects (listDataset). A format's metadata rides on its Shards (unit): the
// sample counts even epochs use instead of counting, and what a shard
// takes once decoded, which the read-ahead budget is charged.
//
// Keys and field names travel as protobuf strings: a sample whose key or
// field name is not UTF-8 (or longer than 4096 or 255 bytes, or with more
// than 1024 fields) is refused, not renamed. A shard whose bytes are
// damaged delivers the samples before the damage. Either fails the epoch
// naming the shard and member (ErrCorruptShard), or with skip_corrupt is
// skipped and counted in CorruptSkipped (a refused sample; the rest of a
// damaged shard).
//
// # Memory
//
// Every byte a session holds is charged to its read-ahead budget (serve's
// --read-ahead-bytes, Options.ReadAheadBytes, R): a quarter for shards
// read ahead whole, half for the shuffle window and the sample being
// read, a quarter for the batches being assembled and waiting for the
// ring. A shard larger than R/8 is streamed (archive/tar over a ranged
// read, resumed where it failed) and never held whole nor cached. The
// samples of a cached shard alias it; when the cache evicts it (the
// lookahead evicts within a dataset being read), the window's samples
// still aliasing it get their own copy at the next shard boundary, so
// that a few stragglers do not keep a whole shard's memory that the
// cache's budget no longer counts. Those of a shard the cache did not
// take are copied out at once, for the same reason. A pooled shard
// (below) is the exception to both: the window keeps aliasing the pooled
// buffers it holds the largest share of, up to R/2 bytes of them and all
// sessions' together up to the pool's room beyond the cache, and copies
// them out as they drain (assembler.unalias). With a cache smaller than the dataset most shards
// are evicted, or not taken, right after they are read, and copying them
// out then copied nearly all the data once more. A
// sample larger than the window or a batch part, or a batch larger than
// R/4, fails with ErrTooLarge (a sample is skipped and counted with
// skip_corrupt). A shard read nobody waits for any more is cancelled.
// A local source's shards above 1 MiB are mapped, not read (mapped.go):
// their bytes are the page cache's, so neither the copy out of it nor new
// memory for the cache is paid; the cache counts them in its budget as
// before, the samples cut from one keep it mapped, and a file truncated
// under a mapping fails the shard (ErrShardChanged) where it is read.
// Shards read into memory (from S3; local ones not mapped) above 1 MiB
// go into buffers outside the Go heap that are used again once nothing
// aliases them (shardmem.go), up to the cache's budget plus R (at least
// 64 MiB); past that, into the heap. The cache counts such a shard's whole buffer.
// With an S3 source allowed, the daemon takes all of that memory at
// start (ServiceConfig.CacheAtStart), until the first iteration opens:
// a first epoch then finds its pages taken.
//
// A dataset's listing (and the cache's plan of the epochs ahead) costs a
// session about 512 bytes and twice the name per shard, within
// --dataset-list-bytes (Options.ListBytes, L; a larger dataset fails to
// open, naming the flag). Sessions take ring slots from the datasets'
// share of the arena before they list or read, so at most
// S = dataset-arena-bytes / (ring-slots × slot-bytes) are open, and the
// service holds at most (Service.MemoryCeiling)
//
//	cache-bytes + 96 MiB + max(R, 64 MiB) + S × (R + 256 KiB + L) + dataset-arena-bytes / slot-bytes × 4 MiB
//
// where 96 MiB bounds the shards' sample counts (CountBytes, 32 MiB) and
// the Parquet footers kept (FooterBytes, 64 MiB), max(R, 64 MiB) the
// shard buffers beyond the cache's (slack), 256 KiB is
// a streamed shard's read buffer and 4 MiB bounds the
// keys and names of a delivery, one per ring slot however the rings grow;
// the rings themselves are arena memory.
//
// # Pacing
//
// The read-ahead budget is a ceiling. Within it, an iteration holds as
// many shard bytes ahead as its consumer needs (pacer): twice the
// consumption rate times a storage read's duration, at least two shards,
// measured as it goes; so a consumer slower than storage holds a couple
// of shards, and one as fast as storage the whole budget. A ring starts
// with ring-slots slots and grows by one, up to ring-slots-max, each time
// its consumer catches up with it after it had been full (it found no
// batch ready and the filler waiting for the iterator): the ring, not
// storage, had bounded the consumer's lead. A ring grows only into room
// of the datasets' share that leaves a starting ring free, so growth
// never keeps the next session from opening.
// The Go runtime may hold up to GOGC% more as garbage unless GOMEMLIMIT
// caps it. (The listing of a dataset, a name per object, is not bounded.)
//
// # The first batch
//
// A session reads ahead from the moment it opens, before any request:
// shards are fetched, the shuffle window filled and batches copied into
// the ring. When a shard before the first batch came from storage, the
// first batch is handed out once the ring is full (or the epoch over),
// waiting for that at most as long again as the first batch took to come
// (at least 50 ms): a consumer that starts on an empty ring and takes
// batches nearly as fast as storage reads them has no lead to absorb a
// late shard, and would wait again and again in its first seconds. A
// full ring is that lead, paid once per epoch, in the time to the first
// batch. An epoch whose first shards were cached starts at once.
//
// # Sources and owners
//
// Only the sources --dataset-allow lists may be read (ErrNotAllowed
// otherwise): see allowList. A session belongs to the connection that
// opened it (Owner), and is closed when that connection closes.
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
// policy can for one pass per epoch. Better still, the order of an epoch
// is a pure function of (seed, epoch, world_size, rank), so each open
// iteration tells the cache which shards it reads next, through its next
// two epochs (lookahead.go), and a full cache follows Belady's rule over
// all of them: the shard read farthest in the future goes, and one whose
// next read (after the one bringing it in) comes later than everything
// cached is not admitted. A read's present is its cache lookup, not its
// consumption: what is read ahead is held by its iteration anyway. One
// pass per epoch then hits what fits (as the optimum does: each shard is
// read once per epoch); one node of a two-node job, reading another half
// each epoch, reads what the offline optimum reads (±1 shard in tests)
// where keeping the cached subset reads 1.4-1.5x that; and several
// iterations reading the dataset in different orders at once (two jobs,
// training and evaluation) share what they read: in a test, 2 passes over
// a dataset twice the cache read 20-30% less from storage than keeping
// the cached subset. The shards of a dataset (a source's backend
// and prefix) nobody has read for DefaultStaleAfter give way to new ones
// when no iteration is open. Each shard is filled under a per-key lock, so
// ranks asking for the same shard at once read it from storage once.
// Behind the memory cache, a disk tier (disk.go, ServiceConfig.DiskCacheDir)
// keeps remote sources' shards as files, written whole and renamed into
// place, checked against a trailer when mapped, evicted by the same
// lookahead.
//
// This package knows nothing of gRPC; the daemon's server adapts it.
package prefetch
