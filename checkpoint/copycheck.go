package checkpoint

import (
	"errors"
	"fmt"
	"sort"

	"github.com/ckptd/ckptd/checkpoint/codec"
)

// ErrStagedChanged: a staged save's bytes are not those its client
// copied (another user of a shared arena rewrote them, or the client
// hashed something else). Nothing of the save was committed. It matches
// ErrCorrupt.
var ErrStagedChanged = fmt.Errorf("%w: the staged bytes changed after the client copied them", ErrCorrupt)

// CopyCheck is what a client says it copied into a staging region: the
// XXH3-64 of each chunk of the save's data space, hashed from its own
// memory (not from the shared region) as it copied. A daemon whose arena
// other users can write asks for it, and stores a save only when the
// bytes it compresses, copied out of the arena first, hash the same: a
// member of --socket-group who rewrites another user's staged bytes then
// fails the save instead of having them stored. XXH3 is a checksum, not a
// MAC: bytes crafted to the same hashes would pass (docs/security.md).
type CopyCheck struct {
	// Ends are the data-space ends of the chunks, increasing, the last
	// the layout's DataSize: the chunks the writer cuts (CheckEnds).
	Ends []int64 `json:"ends"`
	// Hashes are the client's, one per chunk; empty until it commits.
	Hashes []uint64 `json:"hashes,omitempty"`
}

// checkEnds are the data-space ends of the chunks planChunks cuts l into.
func (l *Layout) checkEnds(size, alone int64) []int64 {
	plan := planChunks(l, size, alone)
	ends := make([]int64, len(plan))
	for i, p := range plan {
		ends[i] = p.rawOffset + p.raw
	}
	return ends
}

// Validate checks c against l: ends that cut l's data space into chunks
// of 1 to MaxChunkSize bytes, and, when hashes says they must be there,
// one hash per chunk.
func (c *CopyCheck) Validate(l *Layout, hashes bool) error {
	var prev int64
	for i, e := range c.Ends {
		if e <= prev || e-prev > MaxChunkSize {
			return fmt.Errorf("%w: copy check chunk %d ends at %d, after %d", ErrInvalid, i, e, prev)
		}
		prev = e
	}
	if prev != l.DataSize {
		return fmt.Errorf("%w: copy check chunks end at %d, the data at %d", ErrInvalid, prev, l.DataSize)
	}
	if hashes && len(c.Hashes) != len(c.Ends) {
		return fmt.Errorf("%w: %d copy check hashes for %d chunks (this daemon's arena is shared with "+
			"other users, so it needs the client to hash what it copies: use a client of this ckptd version)",
			ErrInvalid, len(c.Hashes), len(c.Ends))
	}
	return nil
}

// verify compares the chunks a writer or MemoryManifest hashed (from its
// own copy of the staged bytes) with the client's hashes.
func (c *CopyCheck) verify(chunks []Chunk) error {
	if len(chunks) != len(c.Hashes) {
		return fmt.Errorf("%w: %d chunks for %d copy check hashes", ErrStagedChanged, len(chunks), len(c.Hashes))
	}
	for i, ch := range chunks {
		if want := codec.FormatHash(c.Hashes[i]); ch.Hash != want {
			return fmt.Errorf("%w: chunk %d (data bytes %d to %d) hashes %s, the client copied %s",
				ErrStagedChanged, i, ch.RawOffset, ch.RawOffset+ch.Raw, ch.Hash, want)
		}
	}
	return nil
}

// holds reports whether chunks are c's, cut at its ends with its hashes.
func (c *CopyCheck) holds(chunks []Chunk) bool {
	if len(chunks) != len(c.Ends) || c.verify(chunks) != nil {
		return false
	}
	for i, ch := range chunks {
		if ch.RawOffset+ch.Raw != c.Ends[i] {
			return false
		}
	}
	return true
}

// planEnds cuts l's data space at ends (validated), as planChunks would
// have: the spans of each chunk, and the dtype of its first tensor.
func planEnds(l *Layout, ends []int64) []chunkPlan {
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

// RegionHasher hashes a region's bytes as they stream past, in order, into
// the chunks of a CopyCheck: the daemon's own CopyCheck of a save a client
// streams (SaveStream), taken from the stream before the bytes reach the
// shared arena.
type RegionHasher struct {
	plan   []chunkPlan
	pos    int64 // region offset of the next byte
	chunk  int
	span   int
	h      *codec.Hasher
	hashes []uint64
}

// NewRegionHasher hashes the chunks ends cuts l into (ends validated).
func NewRegionHasher(l *Layout, ends []int64) *RegionHasher {
	return &RegionHasher{plan: planEnds(l, ends), h: codec.NewHasher()}
}

// Write takes the region's next bytes.
func (r *RegionHasher) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 && r.chunk < len(r.plan) {
		s := r.plan[r.chunk].spans[r.span]
		if r.pos < s.off { // a gap between tensors
			skip := min(int64(len(p)), s.off-r.pos)
			p, r.pos = p[skip:], r.pos+skip
			continue
		}
		take := min(int64(len(p)), s.off+s.n-r.pos)
		r.h.Write(p[:take])
		p, r.pos = p[take:], r.pos+take
		if r.pos == s.off+s.n {
			r.nextSpan()
		}
	}
	r.pos += int64(len(p)) // past the last chunk
	return n, nil
}

func (r *RegionHasher) nextSpan() {
	r.span++
	if r.span < len(r.plan[r.chunk].spans) {
		return
	}
	r.hashes = append(r.hashes, r.h.Sum64())
	r.h.Reset()
	r.chunk, r.span = r.chunk+1, 0
}

// Sums returns the chunks' hashes; an error unless every chunk was
// streamed whole.
func (r *RegionHasher) Sums() ([]uint64, error) {
	if len(r.hashes) != len(r.plan) {
		return nil, errors.New("the stream ended inside a chunk")
	}
	return r.hashes, nil
}

// Checked widens sel to the whole chunks of m that hold it, back to back
// (the restored bytes then hold each chunk as m hashed it), and returns
// the CopyCheck of those chunks: their ends in the restored bytes and
// their hashes. A reader whose restore lands in an arena other users can
// write copies the bytes out and checks them against it before it uses
// them; the table still says where each tensor (or slice) lies.
func (sel Selection) Checked(m *Manifest) (Selection, *CopyCheck, error) {
	picked := sel.chunks(m)
	check := &CopyCheck{Ends: make([]int64, 0, len(picked)), Hashes: make([]uint64, 0, len(picked))}
	out := Selection{Whole: sel.Whole}
	at := make([]int64, len(picked)) // where each picked chunk lies in the restored bytes
	for k, i := range picked {
		c := m.Chunks[i]
		h, err := codec.ParseHash(c.Hash)
		if err != nil {
			return Selection{}, nil, fmt.Errorf("%w: chunk %d: %w", ErrCorrupt, i, err)
		}
		at[k] = out.Size
		if k > 0 && picked[k-1] == i-1 { // contiguous in data space: one part
			out.parts[len(out.parts)-1].n += c.Raw
		} else {
			out.parts = append(out.parts, part{src: c.RawOffset, n: c.Raw, dst: out.Size})
		}
		out.Size += c.Raw
		check.Ends = append(check.Ends, out.Size)
		check.Hashes = append(check.Hashes, h)
	}
	if sel.Whole {
		out.Table, out.parts = sel.Table, nil
		return out, check, nil
	}
	src := make(map[int64]int64, len(sel.parts)) // a tensor's place in sel -> in data space
	for _, p := range sel.parts {
		src[p.dst] = p.src
	}
	out.Table = make([]Tensor, len(sel.Table))
	for j, t := range sel.Table {
		s := src[t.Offset]
		t.Offset = 0 // an empty tensor lies nowhere
		if t.Length > 0 {
			k := sort.Search(len(picked), func(k int) bool { c := m.Chunks[picked[k]]; return c.RawOffset+c.Raw > s })
			t.Offset = at[k] + s - m.Chunks[picked[k]].RawOffset
		}
		out.Table[j] = t
	}
	return out, check, nil
}

// chunks are the indices of m's chunks that hold sel's bytes, in order.
func (sel Selection) chunks(m *Manifest) []int {
	if sel.Whole {
		out := make([]int, len(m.Chunks))
		for i := range out {
			out[i] = i
		}
		return out
	}
	var out []int
	for _, p := range sel.parts {
		r := chunksOf(m, p.src, p.n)
		for i := r.first; i < r.last; i++ {
			if len(out) == 0 || out[len(out)-1] < i {
				out = append(out, i)
			}
		}
	}
	return out
}
