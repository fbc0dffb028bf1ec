package codec

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/klauspost/compress/huff0"
)

// The float-aware codecs, one per element type because Encode and Decode
// see only bytes. The format is in the package documentation; the writer
// picks one from the chunk's dtype (ForDType).
const (
	FloatBF16 Codec = "float-bf16"
	FloatF16  Codec = "float-f16"
	FloatF32  Codec = "float-f32"
	FloatF64  Codec = "float-f64"
)

// floatGroup is how many elements a group holds (the last one may hold
// fewer). It is part of the format: planes are cut into blocks of this many
// bytes. 64 Ki keeps a group's planes in L2 (256 KiB for fp32) and each
// Huffman block well under huff0's limit, and a table (~40 bytes) per 64 KiB
// costs under 0.1%.
const floatGroup = 1 << 16

// Block kinds.
const (
	blockRaw   = 0 // the plane's bytes
	blockConst = 1 // one byte, repeated
	blockHuff  = 2 // uvarint length, then a huff0 4-stream block with its table
	blockRuns  = 3 // uvarint length, then literal and repeat ops
)

// floatWidth returns the element size of a float codec, or 0.
func floatWidth(c Codec) int {
	switch c {
	case FloatBF16, FloatF16:
		return 2
	case FloatF32:
		return 4
	case FloatF64:
		return 8
	}
	return 0
}

// floatBound is the worst case: every block raw (one kind byte each).
func floatBound(w, n int) int {
	groups := (n/w + floatGroup - 1) / floatGroup
	return n + groups*w
}

// floatScratch is per-call working memory, pooled: w planes of one group,
// a buffer for run-length bodies, and huff0 state.
type floatScratch struct {
	buf    []byte
	planes [8][]byte
	runs   []byte
	// Separate huff0 state per direction: reading a table into the
	// encoder's scratch makes its next Compress4X reallocate.
	henc, hdec huff0.Scratch
}

var floatScratches = freeList[*floatScratch]{fresh: func() (*floatScratch, error) {
	return &floatScratch{henc: huff0.Scratch{Reuse: huff0.ReusePolicyNone}}, nil
}}

// planesFor makes room for w planes of a full group.
func (s *floatScratch) planesFor(w int) *[8][]byte {
	if len(s.buf) < w*floatGroup {
		s.buf = make([]byte, w*floatGroup)
	}
	for p := range w {
		s.planes[p] = s.buf[p*floatGroup : (p+1)*floatGroup]
	}
	return &s.planes
}

func encodeFloat(w int, dst, src []byte) ([]byte, error) {
	s, err := floatScratches.get()
	if err != nil {
		return nil, err
	}
	defer floatScratches.put(s)
	planes := s.planesFor(w)
	n := len(src) / w
	for g := 0; g < n; g += floatGroup {
		k := min(floatGroup, n-g)
		split(w, src[g*w:(g+k)*w], planes, k)
		for p := range w {
			dst = s.appendBlock(dst, planes[p][:k], p == 0)
		}
	}
	return append(dst, src[n*w:]...), nil
}

// appendBlock appends the smallest encoding of one plane block it finds.
// Plane 0 (the exponent) always gets a Huffman try. The others hold
// mantissa bits, near-uniform in trained weights, where a try costs a
// histogram and wins nothing, unless some bit never changes: the sign of
// Adam's second moments (never negative) saves one bit in eight that way.
func (s *floatScratch) appendBlock(dst, b []byte, exponent bool) []byte {
	if isConst(b) {
		return append(dst, blockConst, b[0])
	}
	st := scanPlane(b)
	best := len(b) // what raw costs, less the kind byte every block has
	var body []byte
	kind := byte(blockRaw)
	if exponent || st.constBits != 0 {
		out, _, err := huff0.Compress4X(b, &s.henc)
		if err == nil && len(out)+uvarintLen(len(out)) < best {
			best, body, kind = len(out)+uvarintLen(len(out)), out, blockHuff
		}
	}
	// Runs are tried only when at least 1 word in 8 is one repeated byte:
	// mantissa planes of real weights have almost none, a plane of zero
	// rows (the Adam state of embeddings never looked up) mostly such words.
	if st.uniformWords*8 >= len(b)/8 {
		r, ok := appendRuns(s.runs[:0], b, best)
		s.runs = r // keep the capacity either way
		if ok && len(r)+uvarintLen(len(r)) < best {
			body, kind = r, blockRuns
		}
	}
	dst = append(dst, kind)
	if kind == blockRaw {
		return append(dst, b...)
	}
	dst = binary.AppendUvarint(dst, uint64(len(body)))
	return append(dst, body...)
}

func uvarintLen(n int) int {
	l := 1
	for ; n >= 0x80; n >>= 7 {
		l++
	}
	return l
}

// isConst reports whether b is one byte value repeated (b is not empty).
func isConst(b []byte) bool {
	v := b[0]
	bc := uint64(v) * 0x0101010101010101
	i := 0
	for ; i+8 <= len(b); i += 8 {
		if binary.LittleEndian.Uint64(b[i:i+8]) != bc {
			return false
		}
	}
	for ; i < len(b); i++ {
		if b[i] != v {
			return false
		}
	}
	return true
}

// planeStats is what one pass over a plane block tells.
type planeStats struct {
	uniformWords int  // 8-byte words made of one repeated byte
	constBits    byte // bits equal in every byte
}

// scanPlane reads b a word at a time, once, for appendBlock's decisions.
func scanPlane(b []byte) planeStats {
	var st planeStats
	and, or := ^uint64(0), uint64(0)
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i : i+8])
		and &= x
		or |= x
		if x == uint64(byte(x))*0x0101010101010101 {
			st.uniformWords++
		}
	}
	for ; i < len(b); i++ {
		and &= uint64(b[i]) * 0x0101010101010101
		or |= uint64(b[i])
	}
	// Fold the eight byte lanes: a bit is constant when it is set in every
	// lane's and, or clear in every lane's or.
	and &= and >> 32
	and &= and >> 16
	and &= and >> 8
	or |= or >> 32
	or |= or >> 16
	or |= or >> 8
	st.constBits = byte(and) | ^byte(or)
	return st
}

// minRun is the shortest run appendRuns codes as a repeat: below it the
// two or three bytes of a repeat op do not pay against a literal.
const minRun = 8

// appendRuns appends b as run-length ops (see doc.go: literal stretches and
// repeats) to dst, and gives up (false) once they pass limit bytes. Runs
// are found a word at a time: only a word of one repeated byte starts one,
// so mantissa noise is skipped at memory speed, and runs shorter than 15
// bytes may go unnoticed, which costs little.
func appendRuns(dst, b []byte, limit int) ([]byte, bool) {
	start, lit := len(dst), 0
	for i := 0; i+8 <= len(b); {
		x := binary.LittleEndian.Uint64(b[i : i+8])
		if x != uint64(byte(x))*0x0101010101010101 {
			i += 8
			continue
		}
		s, e := i, runEnd(b, i)
		for s > lit && b[s-1] == b[i] {
			s--
		}
		if e-s >= minRun {
			dst = appendLiteral(dst, b[lit:s])
			dst = binary.AppendUvarint(dst, uint64(e-s-1)<<1|1)
			dst = append(dst, b[i])
			lit = e
			if len(dst)-start >= limit {
				return dst, false
			}
		}
		i = e
	}
	dst = appendLiteral(dst, b[lit:])
	return dst, len(dst)-start < limit
}

func appendLiteral(dst, lit []byte) []byte {
	if len(lit) == 0 {
		return dst
	}
	dst = binary.AppendUvarint(dst, uint64(len(lit)-1)<<1)
	return append(dst, lit...)
}

// runEnd returns the end of the run starting at b[i], comparing a word at a
// time while it can.
func runEnd(b []byte, i int) int {
	v := b[i]
	bc := uint64(v) * 0x0101010101010101
	j := i + 1
	for j+8 <= len(b) && binary.LittleEndian.Uint64(b[j:j+8]) == bc {
		j += 8
	}
	for j < len(b) && b[j] == v {
		j++
	}
	return j
}

// Decoding.

var errTrailing = errors.New("bytes after the last block")

func decodeFloat(c Codec, w int, dst, src []byte, rawLen int) ([]byte, error) {
	n, tail := rawLen/w, rawLen%w
	if len(src) < tail {
		return nil, fmt.Errorf("%w: %s: %d stored bytes, want at least %d", ErrCorrupt, c, len(src), tail)
	}
	body := src[:len(src)-tail]
	// Walk the block headers before allocating anything, so that a raw
	// length the stored bytes cannot hold costs nothing.
	if err := scanFloat(body, w, n); err != nil {
		return nil, corrupt(c, err)
	}
	out := sized(dst, rawLen)[:rawLen]
	s, err := floatScratches.get()
	if err != nil {
		return nil, err
	}
	defer floatScratches.put(s)
	planes := s.planesFor(w)
	for g := 0; g < n; g += floatGroup {
		k := min(floatGroup, n-g)
		for p := range w {
			if body, err = s.readBlock(body, planes[p][:k]); err != nil {
				return nil, corrupt(c, fmt.Errorf("group %d plane %d: %w", g/floatGroup, p, err))
			}
		}
		merge(w, out[g*w:(g+k)*w], planes, k)
	}
	copy(out[n*w:], src[len(src)-tail:])
	return out, nil
}

// scanFloat checks that body is exactly the blocks of n elements of width w,
// judging each block by its kind and declared length only.
func scanFloat(body []byte, w, n int) error {
	for g := 0; g < n; g += floatGroup {
		k := min(floatGroup, n-g)
		for range w {
			size, err := blockSize(body, k)
			if err != nil {
				return err
			}
			body = body[size:]
		}
	}
	if len(body) != 0 {
		return errTrailing
	}
	return nil
}

// blockSize returns the stored size of the block at the start of b, which
// holds k bytes of plane.
func blockSize(b []byte, k int) (int, error) {
	if len(b) == 0 {
		return 0, errors.New("truncated: block missing")
	}
	switch b[0] {
	case blockRaw:
		if len(b) < 1+k {
			return 0, fmt.Errorf("truncated raw block: %d bytes, want %d", len(b)-1, k)
		}
		return 1 + k, nil
	case blockConst:
		if len(b) < 2 {
			return 0, errors.New("truncated constant block")
		}
		return 2, nil
	case blockHuff, blockRuns:
		l, m := binary.Uvarint(b[1:])
		if m <= 0 || l == 0 || l > uint64(len(b)-1-m) {
			return 0, fmt.Errorf("block kind %d: bad length", b[0])
		}
		return 1 + m + int(l), nil
	}
	return 0, fmt.Errorf("unknown block kind %d", b[0])
}

// readBlock decodes the block at the start of b into plane (its length is
// the block's symbol count) and returns the rest of b. scanFloat has
// checked the framing.
func (s *floatScratch) readBlock(b, plane []byte) ([]byte, error) {
	size, err := blockSize(b, len(plane))
	if err != nil {
		return nil, err
	}
	blk, rest := b[:size], b[size:]
	switch blk[0] {
	case blockRaw:
		copy(plane, blk[1:])
	case blockConst:
		fill(plane, blk[1])
	case blockHuff:
		err = s.readHuff(payload(blk), plane)
	case blockRuns:
		err = readRuns(payload(blk), plane)
	}
	return rest, err
}

// payload is the body of a length-prefixed block.
func payload(blk []byte) []byte {
	_, m := binary.Uvarint(blk[1:])
	return blk[1+m:]
}

func (s *floatScratch) readHuff(in, plane []byte) error {
	h, rest, err := huff0.ReadTable(in, &s.hdec)
	if err != nil {
		return fmt.Errorf("huffman table: %w", err)
	}
	// The capacity is the symbol count the decoder must produce: it never
	// writes past it.
	out, err := h.Decoder().Decompress4X(plane[:0:len(plane)], rest)
	if err != nil {
		return fmt.Errorf("huffman block: %w", err)
	}
	if len(out) != len(plane) {
		return fmt.Errorf("huffman block: %d symbols, want %d", len(out), len(plane))
	}
	return nil
}

func readRuns(in, plane []byte) error {
	i := 0
	for len(in) > 0 {
		h, m := binary.Uvarint(in)
		if m <= 0 || h>>1 >= uint64(len(plane)-i) {
			return fmt.Errorf("runs: op %#x at %d overflows %d bytes", h, i, len(plane))
		}
		n := int(h>>1) + 1
		in = in[m:]
		if h&1 == 0 {
			if len(in) < n {
				return errors.New("runs: truncated literal")
			}
			copy(plane[i:i+n], in)
			in = in[n:]
		} else {
			if len(in) < 1 {
				return errors.New("runs: truncated repeat")
			}
			fill(plane[i:i+n], in[0])
			in = in[1:]
		}
		i += n
	}
	if i != len(plane) {
		return fmt.Errorf("runs: cover %d of %d bytes", i, len(plane))
	}
	return nil
}

// fill sets every byte of b to v.
func fill(b []byte, v byte) {
	if v == 0 {
		clear(b)
		return
	}
	if len(b) == 0 {
		return
	}
	b[0] = v
	for n := 1; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
}
