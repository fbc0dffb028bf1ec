package prefetch

import (
	"fmt"
	"math/rand/v2"
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
	// SkipCorrupt skips (and counts) shards that fail to parse instead of
	// failing the iteration.
	SkipCorrupt bool
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
	}
	if s.ShuffleWindow == 0 {
		s.ShuffleWindow = 1000
	}
	f, err := ParseFormat(string(s.Format))
	s.Format = f
	return err
}

// ShardsForRank returns the shards rank reads in epoch: a permutation of
// all shards seeded by (seed, epoch), of which rank takes every
// world_size-th. Ranks beyond the shard count get none.
func ShardsForRank(shards []Shard, seed uint64, epoch int64, rank, worldSize int) []Shard {
	rng := rand.New(rand.NewPCG(seed, uint64(epoch)))
	perm := rng.Perm(len(shards))
	var mine []Shard
	for i := rank; i < len(perm); i += worldSize {
		mine = append(mine, shards[perm[i]])
	}
	return mine
}

// shuffler shuffles a stream of samples within a window: each incoming
// sample replaces a random one of the window, which is emitted. The output
// is a pure function of the input and the seed.
type shuffler struct {
	rng    *rand.Rand
	window []Sample
	size   int
}

func newShuffler(spec *Spec) *shuffler {
	seed2 := uint64(spec.Epoch)<<20 ^ uint64(spec.Rank)
	return &shuffler{rng: rand.New(rand.NewPCG(spec.Seed^0x9e3779b97f4a7c15, seed2)), size: spec.ShuffleWindow}
}

// push adds s and returns a sample to emit once the window is full.
func (sh *shuffler) push(s Sample) (Sample, bool) {
	if len(sh.window) < sh.size {
		sh.window = append(sh.window, s)
		return Sample{}, false
	}
	j := sh.rng.IntN(len(sh.window))
	out := sh.window[j]
	sh.window[j] = s
	return out, true
}

// flush empties the window in random order at the end of the epoch.
func (sh *shuffler) flush() []Sample {
	sh.rng.Shuffle(len(sh.window), func(i, j int) { sh.window[i], sh.window[j] = sh.window[j], sh.window[i] })
	out := sh.window
	sh.window = nil
	return out
}
