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
	parts []part  // where each comes from, sorted by source offset
	srcs  []int64 // where each entry of Table starts in the data space
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
	want := make([]Slice, len(names))
	seen := make(map[string]bool, len(names))
	for i, name := range names {
		if seen[name] {
			return Selection{}, fmt.Errorf("%w: tensor %q is asked for twice", ErrInvalid, name)
		}
		seen[name] = true
		want[i].Name = name
	}
	return selectSlices(m, want, true)
}

// Slice is a byte range of one of a shard's tensors.
type Slice struct {
	Name           string
	Offset, Length int64 // bytes from the tensor's first byte
}

// SelectSlices selects byte ranges of m's tensors, packed back to back in
// order. The table has an entry per slice: the tensor's name, dtype and
// shape, and where the slice's bytes lie in the restored bytes (Offset,
// Length). Slices of one tensor may not overlap.
func SelectSlices(m *Manifest, want []Slice) (Selection, error) {
	if len(want) > MaxTensors {
		return Selection{}, fmt.Errorf("%w: %d slices asked for, more than %d", ErrInvalid, len(want), MaxTensors)
	}
	return selectSlices(m, want, false)
}

// selectSlices selects want of m: each slice whole (the tensor, whatever
// its Offset and Length say) or as it says.
func selectSlices(m *Manifest, want []Slice, whole bool) (Selection, error) {
	byName := make(map[string]int, len(m.Tensors))
	for i, t := range m.Tensors {
		byName[t.Name] = i
	}
	var sel Selection
	for _, sl := range want {
		i, ok := byName[sl.Name]
		if !ok {
			return Selection{}, fmt.Errorf("%w: step %d rank %d has no tensor %q", ErrInvalid, m.Step, m.Rank, sl.Name)
		}
		t := m.Tensors[i]
		if whole {
			sl.Offset, sl.Length = 0, t.Length
		}
		if sl.Offset < 0 || sl.Length < 0 || sl.Offset > t.Length || sl.Length > t.Length-sl.Offset {
			return Selection{}, fmt.Errorf("%w: bytes [%d, +%d) of tensor %q, which has %d", ErrInvalid, sl.Offset, sl.Length, sl.Name, t.Length)
		}
		sel.parts = sel.add(part{src: t.Offset + sl.Offset, n: sl.Length, dst: sel.Size})
		sel.srcs = append(sel.srcs, t.Offset+sl.Offset)
		t.Offset, t.Length = sel.Size, sl.Length
		sel.Table = append(sel.Table, t)
		sel.Size += sl.Length
	}
	slices.SortFunc(sel.parts, func(a, b part) int { return cmp.Compare(a.src, b.src) })
	for i := 1; i < len(sel.parts); i++ {
		if a, b := sel.parts[i-1], sel.parts[i]; b.src < a.src+a.n {
			return Selection{}, fmt.Errorf("%w: step %d rank %d: slices of tensor bytes [%d, +%d) and [%d, +%d) of the shard overlap", ErrInvalid, m.Step, m.Rank, a.src, a.n, b.src, b.n)
		}
	}
	return sel, nil
}

// InPlace is the selection as it lies in m's data space, for a restore
// that hands out the data space itself rather than a packed copy: the
// span [lo, lo+size) holding every selected byte, and the table with its
// offsets into that span. The span holds the bytes between the selected
// ones too.
func (s Selection) InPlace(m *Manifest) (lo, size int64, table []Tensor) {
	if s.Whole {
		return 0, m.DataSize, m.Tensors
	}
	if len(s.parts) > 0 {
		lo = s.parts[0].src
	}
	hi := lo
	for _, p := range s.parts {
		hi = max(hi, p.src+p.n)
	}
	table = make([]Tensor, len(s.Table))
	for i, t := range s.Table {
		t.Offset = min(max(s.srcs[i]-lo, 0), hi-lo) // an empty slice may lie outside the span
		table[i] = t
	}
	return lo, hi - lo, table
}

// add returns the parts with p, unless it is empty: an empty part copies
// nothing, and left out it cannot break the order of the parts' ends that
// finding a chunk's parts relies on (an empty tensor may start where
// another does).
func (s Selection) add(p part) []part {
	if p.n == 0 {
		return s.parts
	}
	return append(s.parts, p)
}

// dataRange is a span of data space to fetch.
type dataRange struct{ off, n int64 }

// ranges returns the data-space ranges to fetch: the parts, merged where
// they touch. Parts further apart are not merged: a gap holds whole
// chunks no part needs, which reading would only waste (ReadSelected
// fetches ranges whose chunks are adjacent in one read all the same).
func (s Selection) ranges() []dataRange {
	var out []dataRange
	for _, p := range s.parts {
		if k := len(out) - 1; k >= 0 && p.src <= out[k].off+out[k].n {
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
