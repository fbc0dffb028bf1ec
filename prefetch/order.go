package prefetch

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
)

// Spec is one rank's iteration over one epoch of a dataset.
type Spec struct {
	Format    Format
	BatchSize int
	Rank      int
	WorldSize int
	Seed      uint64
	Epoch     int64
	// Start is how many samples this rank already consumed this epoch.
	Start int64
	// ShuffleWindow is the sample shuffle buffer (default 1000; 1 keeps
	// the shard order).
	ShuffleWindow int
	// ShuffleBlock, when not 0, shuffles in blocks of this many of the
	// rank's shards instead of the window: all samples of a block, then
	// a permutation of them (see shuffler).
	ShuffleBlock int
	// SkipCorrupt skips (and counts) shards that fail to parse instead of
	// failing the iteration.
	SkipCorrupt bool
	// Delivered, when set, resumes the epoch from the samples it holds
	// (the union of every rank's Iterator.Delivered), at any world size:
	// the shards not fully delivered are dealt anew among the ranks, and
	// the samples delivered are passed over. Start then counts samples of
	// that resumed order.
	Delivered *Delivered
	// Even says how the epoch's samples are shared out among the ranks
	// ("": EvenPad).
	Even Even
	// BatchDelivered makes the session send each batch's samples as a
	// position (Delivery.Delivered).
	BatchDelivered bool
}

// Validate checks the spec and fills defaults.
func (s *Spec) Validate() error {
	switch {
	case s.BatchSize <= 0:
		return fmt.Errorf("%w: batch_size must be positive, got %d", ErrInvalid, s.BatchSize)
	case s.WorldSize <= 0:
		return fmt.Errorf("%w: world_size must be positive, got %d", ErrInvalid, s.WorldSize)
	case s.Rank < 0 || s.Rank >= s.WorldSize:
		return fmt.Errorf("%w: rank %d out of range [0, world_size %d)", ErrInvalid, s.Rank, s.WorldSize)
	case s.Epoch < 0 || s.Start < 0:
		return fmt.Errorf("%w: epoch and start must not be negative (got %d, %d)", ErrInvalid, s.Epoch, s.Start)
	case s.ShuffleWindow < 0:
		return fmt.Errorf("%w: shuffle window must not be negative, got %d", ErrInvalid, s.ShuffleWindow)
	case s.ShuffleBlock < 0 || s.ShuffleBlock > MaxShuffleBlock:
		return fmt.Errorf("%w: shuffle block must be 0 (off) to %d shards, got %d", ErrInvalid, MaxShuffleBlock, s.ShuffleBlock)
	}
	if s.ShuffleWindow == 0 {
		s.ShuffleWindow = 1000
	}
	f, err := ParseFormat(string(s.Format))
	if err != nil {
		return err
	}
	s.Format = f
	s.Even, err = ParseEven(string(s.Even))
	return err
}

// ShardsForRank returns the shards rank reads in epoch: a permutation of
// all shards seeded by (seed, epoch), of which rank takes every
// world_size-th. Ranks beyond the shard count get none.
func ShardsForRank(shards []Shard, seed uint64, epoch int64, rank, worldSize int) []Shard {
	return deal(epochOrder(shards, seed, epoch, nil), rank, worldSize)
}

// shardPerm is the epoch's permutation of n shards.
func shardPerm(n int, seed uint64, epoch int64) []int {
	return rand.New(rand.NewPCG(seed, uint64(epoch))).Perm(n)
}

// MaxShuffleBlock bounds Spec.ShuffleBlock.
const MaxShuffleBlock = 1 << 16

// shuffler shuffles a stream of samples within a window: once the window
// holds `initial` samples, each push emits a random one. The window then
// grows by one every second push up to `size`, as WebDataset's does, so the
// first batch needs a few samples, not a whole window. The assembler also
// pops samples when the window's bytes reach their bound. The output is a
// pure function of the input (samples and their sizes) and the seed.
//
// With a block (Spec.ShuffleBlock) push emits nothing: the assembler
// flushes the window, a permutation of everything in it, after every
// block of shards, as Mosaic's block shuffles permute the samples of
// blocks of shards. Neighbours then come from any shard of the block,
// where a window smaller than a shard draws most of them from one.
type shuffler struct {
	rng     *rand.Rand
	window  []Sample
	size    int
	initial int
	pushes  int
	block   int // shards a block (0: the sliding window)
	shards  int // shards ended in the current block
}

func newShuffler(spec *Spec) *shuffler {
	seed2 := uint64(spec.Epoch)<<20 ^ uint64(spec.Rank)
	return &shuffler{
		rng:  rand.New(rand.NewPCG(spec.Seed^0x9e3779b97f4a7c15, seed2)),
		size: spec.ShuffleWindow, initial: min(spec.ShuffleWindow, 100), block: spec.ShuffleBlock,
	}
}

// push adds s and returns a sample to emit once the window is full.
func (sh *shuffler) push(s Sample) (Sample, bool) {
	sh.window = append(sh.window, s)
	sh.pushes++
	n := len(sh.window)
	if sh.block > 0 || n < sh.initial || n < sh.size && sh.pushes%2 == 1 {
		return Sample{}, false
	}
	return sh.pop(), true
}

// endShard counts a shard read to its end; with a block, it returns the
// block's samples, shuffled, when this shard ends the block.
func (sh *shuffler) endShard() []Sample {
	if sh.block == 0 {
		return nil
	}
	if sh.shards++; sh.shards < sh.block {
		return nil
	}
	sh.shards = 0
	return sh.flush()
}

// pop takes a random sample out of the window, which must not be empty.
func (sh *shuffler) pop() Sample {
	n := len(sh.window)
	j := sh.rng.IntN(n)
	out := sh.window[j]
	sh.window[j] = sh.window[n-1]
	sh.window[n-1] = Sample{} // no reference left to its bytes
	sh.window = sh.window[:n-1]
	return out
}

func (sh *shuffler) len() int { return len(sh.window) }

// unalias gives the window's samples whose shard the cache let go their
// own copy of their bytes (see mapping): their cost is charged to the
// window already, and the shard's memory is then freed. A shard evicted
// just after it was read is still mostly in the window, though, and
// copying it out would cost nearly a copy of the data: so pooled
// buffers, whose memory the pool's room beyond the cache counts, keep
// being aliased while the window holds the largest share of them, up to
// budget bytes of buffer in all. It returns the bytes of the buffers it
// kept, for the caller to sweep again as they drain.
func (sh *shuffler) unalias(budget int64) (kept int64) {
	live := map[*mapping]int64{}
	for i := range sh.window {
		if k := sh.window[i].keep; k != nil && k.evicted.Load() {
			live[k] += sh.window[i].Size()
		}
	}
	if len(live) == 0 {
		return 0
	}
	pooled := make([]*mapping, 0, len(live))
	for m := range live {
		if m.slot != nil {
			pooled = append(pooled, m)
		}
	}
	share := func(m *mapping) float64 { return float64(live[m]) / float64(max(len(m.slot.buf), 1)) }
	slices.SortFunc(pooled, func(a, b *mapping) int { return cmp.Compare(share(b), share(a)) })
	keep := map[*mapping]bool{}
	for _, m := range pooled {
		if kept+int64(len(m.slot.buf)) > budget {
			break
		}
		keep[m] = true
		kept += int64(len(m.slot.buf))
	}
	for i := range sh.window {
		if _, evicted := live[sh.window[i].keep]; evicted && !keep[sh.window[i].keep] {
			sh.window[i].own()
		}
	}
	return kept
}

// flush empties the window in random order at the end of the epoch.
func (sh *shuffler) flush() []Sample {
	sh.rng.Shuffle(len(sh.window), func(i, j int) { sh.window[i], sh.window[j] = sh.window[j], sh.window[i] })
	out := sh.window
	sh.window = nil
	return out
}
