package checkpoint

import (
	"errors"
	"fmt"
	"runtime"
	"sort"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/checkpoint/codec"
)

// ErrStagedChanged: a staged save's bytes are not those its client
// copied (another user of a shared arena rewrote them, or the client
// hashed something else). Nothing of the save was committed. It matches
// ErrCorrupt.
var ErrStagedChanged = fmt.Errorf("%w: the staged bytes changed after the client copied them", ErrCorrupt)

// CopyCheck is what a client says it copied into a staging region: the
// MAC (codec.MAC, keyed BLAKE3) of each chunk of the save's data space,
// under a key the daemon gave that lease alone, taken from the client's
// own memory (not from the shared region) as it copied. A daemon whose
// arena other users can write asks for it, and stores a save only when
// the bytes it compresses, copied out of the arena first, have the same
// MACs: a member of --socket-group, who cannot read the key, can spoil
// another user's save (it fails) but not forge one.
type CopyCheck struct {
	// Ends are the data-space ends of the chunks, increasing, the last
	// the layout's DataSize: the chunks the writer cuts (CheckEnds).
	Ends []int64 `json:"ends"`
	// Key keys the MACs: random, one per lease.
	Key []byte `json:"key"`
	// Hashes are the client's MACs, one per chunk; empty until it commits.
	Hashes []uint64 `json:"hashes,omitempty"`
}

// NewCopyCheck is a check of chunks ending at ends, under a new key.
func NewCopyCheck(ends []int64) *CopyCheck {
	return &CopyCheck{Ends: ends, Key: codec.NewMACKey()}
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
	if len(c.Key) != codec.MACKeySize {
		return fmt.Errorf("%w: a copy check key of %d bytes", ErrInvalid, len(c.Key))
	}
	if hashes && len(c.Hashes) != len(c.Ends) {
		return fmt.Errorf("%w: %d copy check hashes for %d chunks (this daemon's arena is shared with "+
			"other users, so it needs the client to hash what it copies: use a client of this ckptd version)",
			ErrInvalid, len(c.Hashes), len(c.Ends))
	}
	return nil
}

// mac returns a MAC under c's key (validated).
func (c *CopyCheck) mac() *codec.MAC {
	m, _ := codec.NewMAC(c.Key)
	return m
}

// verify compares the MACs of the chunks a writer or MemoryManifest cut
// (from its own copy of the staged bytes) with the client's.
func (c *CopyCheck) verify(macs []uint64) error {
	if len(macs) != len(c.Hashes) {
		return fmt.Errorf("%w: %d chunks for %d copy check hashes", ErrStagedChanged, len(macs), len(c.Hashes))
	}
	var start int64
	for i, m := range macs {
		if m != c.Hashes[i] {
			return fmt.Errorf("%w: chunk %d (data bytes %d to %d) is not what the client copied", ErrStagedChanged, i, start, c.Ends[i])
		}
		start = c.Ends[i]
	}
	return nil
}

// holds reports whether chunks, stored, are c's: cut at its ends, and with
// the hashes of data (a region of layout l) whose MACs are c's.
func (c *CopyCheck) holds(chunks []Chunk, l *Layout, data []byte) bool {
	if len(chunks) != len(c.Ends) || len(c.Hashes) != len(c.Ends) {
		return false
	}
	var buf []byte
	mac := c.mac()
	for i, p := range l.planEnds(c.Ends) {
		raw := p.gather(data, &buf, true)
		mac.Reset()
		mac.Write(raw)
		if chunks[i].RawOffset != p.rawOffset || chunks[i].Raw != p.raw || mac.Sum64() != c.Hashes[i] ||
			codec.HashString(raw) != chunks[i].Hash {
			return false
		}
	}
	return true
}

// Matches reports whether data, a copy of the data space, has c's MACs.
func (c *CopyCheck) Matches(data []byte) bool {
	if len(c.Ends) > 0 && c.Ends[len(c.Ends)-1] != int64(len(data)) {
		return false
	}
	sums, err := Sums(c.Key, c.Ends, data)
	return err == nil && c.verify(sums) == nil
}

// Sums returns the MACs of the chunks of data, a data space, that ends
// cut, under key, on every CPU: a daemon's check of bytes it hands out.
func Sums(key []byte, ends []int64, data []byte) ([]uint64, error) {
	out := make([]uint64, len(ends))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i, end := range ends {
		g.Go(func() error {
			m, err := codec.NewMAC(key)
			if err != nil {
				return err
			}
			start := int64(0)
			if i > 0 {
				start = ends[i-1]
			}
			m.Write(data[start:end])
			out[i] = m.Sum64()
			return nil
		})
	}
	return out, g.Wait()
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
	h      *codec.MAC
	hashes []uint64
}

// NewRegionHasher takes the MACs of the chunks c cuts l into (c validated
// but for its hashes).
func NewRegionHasher(l *Layout, c *CopyCheck) *RegionHasher {
	return &RegionHasher{plan: l.planEnds(c.Ends), h: c.mac()}
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

// Checked widens sel to the whole chunks of m that hold it, back to back,
// and returns a CopyCheck of those chunks (their ends in the restored
// bytes, and a new key) for the caller to sum (Sums) from a copy of its
// own once it has filled it. A reader whose restore lands in an arena
// other users can write copies the bytes out and checks them against it
// before it uses them; the table still says where each tensor (or slice)
// lies.
func (sel Selection) Checked(m *Manifest) (Selection, *CopyCheck) {
	picked := sel.chunks(m)
	check := NewCopyCheck(make([]int64, 0, len(picked)))
	out := Selection{Whole: sel.Whole}
	at := make([]int64, len(picked)) // where each picked chunk lies in the restored bytes
	for k, i := range picked {
		c := m.Chunks[i]
		at[k] = out.Size
		if k > 0 && picked[k-1] == i-1 { // contiguous in data space: one part
			out.parts[len(out.parts)-1].n += c.Raw
		} else {
			out.parts = append(out.parts, part{src: c.RawOffset, n: c.Raw, dst: out.Size})
		}
		out.Size += c.Raw
		check.Ends = append(check.Ends, out.Size)
	}
	if sel.Whole {
		out.Table, out.parts = sel.Table, nil
		return out, check
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
	return out, check
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
