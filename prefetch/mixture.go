package prefetch

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"

	"github.com/ckptd/ckptd/storage"
)

// A mixture reads several sources in one session, each a share of its
// shards set by its weight, as Mosaic's Stream(proportion=...) and
// litdata's CombinedStreamingDataset mix theirs.
//
// An epoch of a mixture of sources with S_i shards each is N = sum S_i
// shard reads, of which source i gets n_i, its weight's share of N (the
// largest remainders rounded up, at least one each). Source i's reads
// continue its own sequence of epochs from where the mixture's previous
// epoch left it: mixture epoch e reads its shards e*n_i to (e+1)*n_i - 1,
// the k-th of which is shard k mod S_i of source i's epoch k / S_i (a
// permutation of its shards seeded by the seed, the source's place and
// that epoch). So every source epoch delivers each of its shards exactly
// once, however its weight spreads it over mixture epochs: a source
// weighted above its size repeats within a mixture epoch, one below it
// spreads a source epoch over several. Which source each read of the
// epoch comes from is a shuffle seeded by (seed, epoch). The order is
// then dealt to ranks, shuffled within the window, and resumed (start, or
// delivered at any world size) as a single source's is: the shards' ids in
// positions are "source:source-epoch/name". Weights are shares of shards,
// so of samples when the sources' shards hold alike.

// MixSource is one source of a mixture.
type MixSource struct {
	Backend storage.Backend
	Prefix  string
	Format  Format
	Weight  float64
}

// MaxMixSources bounds the sources of one mixture.
const MaxMixSources = 16

// mixture is a mixture's sources' shards and their shares of an epoch.
type mixture struct {
	lists  [][]Shard
	counts []int64 // reads of source i per mixture epoch
	seed   uint64
}

// OpenMixture starts one rank's iteration over one epoch of a mixture of
// sources (see above); spec.Format is not used, each source has its own.
func OpenMixture(ctx context.Context, sources []MixSource, cache *Cache, spec Spec, opts Options) (*Iterator, error) {
	if len(sources) == 0 || len(sources) > MaxMixSources {
		return nil, fmt.Errorf("%w: a mixture of %d sources: give 1 to %d", ErrInvalid, len(sources), MaxMixSources)
	}
	spec.Format = Auto
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	opts.setDefaults()
	m := &mixture{seed: spec.Seed}
	var srcs []*shardSource
	var weights []float64
	budget := opts.ListBytes
	for i, s := range sources {
		if !(s.Weight > 0) || math.IsInf(s.Weight, 0) {
			return nil, fmt.Errorf("%w: mixture source %d: weight %v: give a positive weight", ErrInvalid, i, s.Weight)
		}
		f, err := ParseFormat(string(s.Format))
		if err != nil {
			return nil, fmt.Errorf("mixture source %d: %w", i, err)
		}
		all, format, err := listDataset(ctx, s.Backend, s.Prefix, f, budget, cache)
		if err != nil {
			return nil, fmt.Errorf("mixture source %d: %w", i, err)
		}
		budget -= listedCost(all)
		src := &shardSource{b: s.Backend, prefix: s.Prefix, format: format, keyPrefix: strconv.Itoa(i) + "/"}
		for j := range all {
			all[j].src = src
		}
		srcs, weights = append(srcs, src), append(weights, s.Weight)
		m.lists = append(m.lists, all)
	}
	m.counts = shares(m.lists, weights)
	var total int64
	for _, n := range m.counts {
		total += n
	}
	if spec.Epoch > math.MaxInt64/2/total {
		return nil, fmt.Errorf("%w: epoch %d of a mixture of %d reads an epoch is too far", ErrInvalid, spec.Epoch, total)
	}
	return start(ctx, srcs, m.epoch, cache, spec, opts)
}

// shares is each source's reads of a mixture epoch: its weight's share of
// all the sources' shards, the largest remainders rounded up, at least 1.
func shares(lists [][]Shard, weights []float64) []int64 {
	var n, sum float64
	for i := range lists {
		n += float64(len(lists[i]))
		sum += weights[i]
	}
	counts := make([]int64, len(lists))
	rest := make([]float64, len(lists))
	var given int64
	for i, w := range weights {
		exact := n * w / sum
		counts[i] = int64(exact)
		rest[i] = exact - float64(counts[i])
		given += counts[i]
	}
	for left := int64(n) - given; left > 0; left-- {
		best := 0
		for i := range rest {
			if rest[i] > rest[best] {
				best = i
			}
		}
		counts[best]++
		rest[best] = -1
	}
	for i := range counts {
		counts[i] = max(counts[i], 1)
	}
	return counts
}

// epoch is the mixture's shard order of epoch e, without the shards
// delivered holds whole (an epochFunc).
func (m *mixture) epoch(e int64, delivered *Delivered) []Shard {
	var picks []int
	for i, n := range m.counts {
		for range n {
			picks = append(picks, i)
		}
	}
	rng := rand.New(rand.NewPCG(m.seed^0x6d69787475726573, uint64(e))) // "mixtures"
	rng.Shuffle(len(picks), func(a, b int) { picks[a], picks[b] = picks[b], picks[a] })
	taken := make([]int64, len(m.lists))
	type permKey struct {
		src   int
		epoch int64
	}
	perms := map[permKey][]int{}
	out := make([]Shard, 0, len(picks))
	for _, i := range picks {
		list := m.lists[i]
		g := e*m.counts[i] + taken[i]
		taken[i]++
		k, pos := g/int64(len(list)), g%int64(len(list))
		perm, ok := perms[permKey{i, k}]
		if !ok {
			perm = rand.New(rand.NewPCG(m.seed+uint64(i+1)*0x9e3779b97f4a7c15, uint64(k))).Perm(len(list))
			perms[permKey{i, k}] = perm
		}
		sh := list[perm[pos]]
		sh.id = strconv.Itoa(i) + ":" + strconv.FormatInt(k, 10) + "/" + sh.Name
		if delivered == nil || !delivered.Done(sh.id) {
			out = append(out, sh)
		}
	}
	return out
}
