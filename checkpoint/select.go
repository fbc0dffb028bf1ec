package checkpoint

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sort"
)

// Selection is what a restore hands out: the whole shard, or some of its
// tensors packed back to back.
type Selection struct {
	Whole bool
	Table []Tensor // the restored tensors, offsets in the restored bytes
	Size  int64
	parts []part // where each comes from, sorted by source offset
}

// part is one tensor's bytes: at src in the shard's data space, n bytes,
// to dst in the restored bytes.
type part struct{ src, n, dst int64 }

// SelectTensors selects names of m (all of it when names is empty).
func SelectTensors(m *Manifest, names []string) (Selection, error) {
	if len(names) == 0 {
		return Selection{Whole: true, Table: m.Tensors, Size: m.DataSize}, nil
	}
	if len(names) > MaxTensors {
		return Selection{}, fmt.Errorf("%w: %d tensors asked for, more than %d", ErrInvalid, len(names), MaxTensors)
	}
	byName := make(map[string]int, len(m.Tensors))
	for i, t := range m.Tensors {
		byName[t.Name] = i
	}
	var sel Selection
	seen := make(map[string]bool, len(names))
	for _, name := range names {
		i, ok := byName[name]
		if !ok || seen[name] {
			return Selection{}, fmt.Errorf("%w: step %d rank %d has no tensor %q (or it is asked for twice)", ErrInvalid, m.Step, m.Rank, name)
		}
		seen[name] = true
		t := m.Tensors[i]
		sel.parts = append(sel.parts, part{src: t.Offset, n: t.Length, dst: sel.Size})
		t.Offset = sel.Size
		sel.Table = append(sel.Table, t)
		sel.Size += t.Length
	}
	slices.SortFunc(sel.parts, func(a, b part) int { return cmp.Compare(a.src, b.src) })
	return sel, nil
}

// readRange is a span of data space to fetch.
type dataRange struct{ off, n int64 }

// mergeGap is how far apart two selected tensors may lie and still be
// fetched in one range: chunks are at most this large, so a smaller gap
// costs at most a chunk read for nothing, and saves a request.
const mergeGap = 4 << 20

// ranges returns the data-space ranges to fetch: the parts, merged where
// they lie close.
func (s Selection) ranges() []dataRange {
	var out []dataRange
	for _, p := range s.parts {
		if p.n == 0 {
			continue
		}
		if k := len(out) - 1; k >= 0 && p.src <= out[k].off+out[k].n+mergeGap {
			out[k].n = max(out[k].n, p.src+p.n-out[k].off)
			continue
		}
		out = append(out, dataRange{p.src, p.n})
	}
	return out
}

// ReadSelected reads sel of the shard m describes from storage into dst
// (sel.Size bytes), verifying every chunk it reads. The chunks of all its
// ranges are read concurrently, and a chunk that lies within one
// selected tensor is read (and decoded) straight into its place in dst.
func (s *Store) ReadSelected(ctx context.Context, m *Manifest, sel Selection, dst []byte, opts ReadOptions) error {
	if sel.Whole {
		return s.ReadShard(ctx, m, BufferSink(dst), opts)
	}
	var spans []readRange
	for _, r := range sel.ranges() {
		c := chunksOf(m, r.off, r.n)
		if k := len(spans) - 1; k >= 0 && c.first <= spans[k].last {
			spans[k].last = max(spans[k].last, c.last) // ranges that share a chunk
			continue
		}
		if c.first < c.last {
			spans = append(spans, c)
		}
	}
	return s.readChunks(ctx, m, spans, &scatterSink{parts: sel.parts, dst: dst}, opts)
}

// scatterSink writes what falls in its parts' sources to their
// destinations. ReadRange hands it whole chunks, from several goroutines;
// the parts' destinations do not overlap.
type scatterSink struct {
	parts []part // sorted by src
	dst   []byte
}

// target is where data-space bytes [off, off+n) go when one part holds
// them all.
func (s *scatterSink) target(off, n int64) []byte {
	i := sort.Search(len(s.parts), func(i int) bool { return s.parts[i].src+s.parts[i].n > off })
	if i == len(s.parts) || s.parts[i].src > off || s.parts[i].src+s.parts[i].n < off+n {
		return nil
	}
	pt := s.parts[i]
	return s.dst[pt.dst+off-pt.src : pt.dst+off-pt.src+n]
}

func (s *scatterSink) WriteAt(p []byte, at int64) (int, error) {
	end := at + int64(len(p))
	i := sort.Search(len(s.parts), func(i int) bool { return s.parts[i].src+s.parts[i].n > at })
	for ; i < len(s.parts) && s.parts[i].src < end; i++ {
		pt := s.parts[i]
		lo, hi := max(at, pt.src), min(end, pt.src+pt.n)
		if lo < hi {
			copy(s.dst[pt.dst+lo-pt.src:], p[lo-at:hi-at])
		}
	}
	return len(p), nil
}
