package checkpoint

import (
	"fmt"
	"math"
	"sort"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// MaxTensors bounds a tensor table, so a request cannot make the daemon
// build an unbounded manifest. The largest real shards (a mixture of
// experts' weights and optimizer state on one rank) hold tens of
// thousands.
const MaxTensors = 1 << 18

// Layout is a validated staging tensor table. Staged tensors sit anywhere in
// their region (gaps allowed, overlaps not); stored tensors are packed back
// to back in the same order.
type Layout struct {
	Region     []Tensor // offsets relative to the region, sorted by offset
	Packed     []Tensor // the same tensors, offsets in data space
	RegionSize int64    // bytes of region the table needs
	DataSize   int64    // bytes of tensor data
}

// NewLayout validates a staging tensor table: names, dtypes, dtype × shape
// == length, and ranges that neither overlap nor go negative. Zero-length
// tensors are allowed anywhere.
func NewLayout(tensors []Tensor) (*Layout, error) {
	if len(tensors) > MaxTensors {
		return nil, fmt.Errorf("%w: %d tensors, more than %d", ErrInvalid, len(tensors), MaxTensors)
	}
	ts := append([]Tensor(nil), tensors...)
	sort.SliceStable(ts, func(i, j int) bool { return ts[i].Offset < ts[j].Offset })
	l := &Layout{Region: ts, Packed: make([]Tensor, len(ts))}
	seen := make(map[string]bool, len(ts))
	var end int64
	var prev string
	for i, t := range ts {
		if err := checkTensor(t, seen); err != nil {
			return nil, err
		}
		if t.Offset < 0 {
			return nil, fmt.Errorf("%w: tensor %q has negative offset %d", ErrInvalid, t.Name, t.Offset)
		}
		tEnd, ok := addInt64(t.Offset, t.Length)
		if !ok {
			return nil, fmt.Errorf("%w: tensor %q: offset %d + length %d overflows", ErrInvalid, t.Name, t.Offset, t.Length)
		}
		if t.Offset < end && t.Length > 0 {
			return nil, fmt.Errorf("%w: tensor %q [%d, %d) overlaps tensor %q", ErrInvalid, t.Name, t.Offset, tEnd, prev)
		}
		p := t
		p.Offset = l.DataSize
		l.Packed[i] = p
		if l.DataSize, ok = addInt64(l.DataSize, t.Length); !ok {
			return nil, fmt.Errorf("%w: the tensors' total size overflows at tensor %q", ErrInvalid, t.Name)
		}
		if t.Length > 0 {
			end, prev = tEnd, t.Name
		}
		l.RegionSize = max(l.RegionSize, tEnd)
	}
	return l, nil
}

// CheckRegion fails when the table does not fit a region of n bytes.
func (l *Layout) CheckRegion(n int64) error {
	if l.RegionSize > n {
		return fmt.Errorf("%w: tensor table needs %d bytes, region has %d", ErrInvalid, l.RegionSize, n)
	}
	return nil
}

// span is a byte range of the staging region.
type span struct{ off, n int64 }

// chunkPlan is one chunk to cut: its place in data space and the region
// spans that hold its bytes (one, unless tensors have gaps between them).
type chunkPlan struct {
	rawOffset, raw int64
	dtype          dtype.DType
	spans          []span
}

// planChunks cuts the data space into chunks of at most size bytes that
// never mix dtypes, so a float-aware codec sees one element type per chunk.
// size must be a multiple of 8 so that splits fall on element boundaries.
// A tensor of at least alone bytes (0: none) has chunks of its own, so
// that a change to a small neighbour leaves them as they were: what an
// incremental save needs to reference a frozen weight's chunks while the
// adapters packed beside it train.
func (l *Layout) planChunks(size, alone int64) []chunkPlan {
	var out []chunkPlan
	var cur chunkPlan
	flush := func() {
		if cur.raw > 0 {
			out = append(out, cur)
		}
		cur = chunkPlan{rawOffset: cur.rawOffset + cur.raw}
	}
	for _, t := range l.Region {
		if t.Length == 0 {
			continue
		}
		own := alone > 0 && t.Length >= alone
		if cur.raw > 0 && (cur.dtype != t.DType || own) {
			flush()
		}
		cur.dtype = t.DType
		for off, rem := t.Offset, t.Length; rem > 0; {
			n := min(rem, size-cur.raw)
			cur.spans = appendSpan(cur.spans, span{off, n})
			cur.raw += n
			off, rem = off+n, rem-n
			if cur.raw == size {
				flush()
				cur.dtype = t.DType
			}
		}
		if own {
			flush()
		}
	}
	flush()
	return out
}

// checkEnds are the data-space ends of the chunks planChunks cuts l into.
func (l *Layout) checkEnds(size, alone int64) []int64 {
	plan := l.planChunks(size, alone)
	ends := make([]int64, len(plan))
	for i, p := range plan {
		ends[i] = p.rawOffset + p.raw
	}
	return ends
}

// planEnds cuts the data space at ends (validated), as planChunks would
// have: the spans of each chunk, and the dtype of its first tensor.
func (l *Layout) planEnds(ends []int64) []chunkPlan {
	out := make([]chunkPlan, 0, len(ends))
	cur := chunkPlan{}
	ti, tOff := 0, int64(0) // tensor of Region, and bytes of it already planned
	for _, end := range ends {
		cur.raw = end - cur.rawOffset
		for need := cur.raw; need > 0; {
			t := l.Region[ti]
			if tOff == t.Length {
				ti, tOff = ti+1, 0
				continue
			}
			if len(cur.spans) == 0 {
				cur.dtype = t.DType
			}
			n := min(need, t.Length-tOff)
			cur.spans = appendSpan(cur.spans, span{t.Offset + tOff, n})
			tOff, need = tOff+n, need-n
		}
		out = append(out, cur)
		cur = chunkPlan{rawOffset: end}
	}
	return out
}

// gather returns the chunk's bytes: a slice of data when they are
// contiguous (the usual case) and not private, else a copy into *buf.
func (cp chunkPlan) gather(data []byte, buf *[]byte, private bool) []byte {
	if len(cp.spans) == 1 && !private {
		s := cp.spans[0]
		return data[s.off : s.off+s.n]
	}
	b := (*buf)[:0]
	for _, s := range cp.spans {
		b = append(b, data[s.off:s.off+s.n]...)
	}
	*buf = b
	return b
}

// appendSpan merges adjacent spans so that a packed table yields one span
// per chunk, which the writer can compress without copying.
func appendSpan(ss []span, s span) []span {
	if n := len(ss); n > 0 && ss[n-1].off+ss[n-1].n == s.off {
		ss[n-1].n += s.n
		return ss
	}
	return append(ss, s)
}

// regionSpans returns the region spans that hold data-space bytes
// [off, off+n), or false when the range is not inside the data. Tensors
// may have gaps between them in the region (a client aligning each to its
// element size), so data and region offsets differ.
func (l *Layout) regionSpans(off, n int64) ([]span, bool) {
	if off < 0 || n < 0 || off > l.DataSize || n > l.DataSize-off {
		return nil, false
	}
	var out []span
	for i, p := range l.Packed {
		lo, hi := max(off, p.Offset), min(off+n, p.Offset+p.Length)
		if lo < hi {
			out = append(out, span{off: l.Region[i].Offset + lo - p.Offset, n: hi - lo})
		}
	}
	return out, true
}

// Pack copies a staged shard's tensors from region, laid out as the save
// leased them, into data, its data space.
func (l *Layout) Pack(region, data []byte) {
	for i, p := range l.Packed {
		r := l.Region[i]
		copy(data[p.Offset:p.Offset+p.Length], region[r.Offset:r.Offset+r.Length])
	}
}

// addInt64 returns a+b for non-negative a and b, and false when the sum
// does not fit: every size a client or a stored file hands over is summed
// with it, so that a crafted 2^62 cannot wrap around to a small number.
func addInt64(a, b int64) (int64, bool) {
	if a < 0 || b < 0 || a > math.MaxInt64-b {
		return 0, false
	}
	return a + b, true
}
