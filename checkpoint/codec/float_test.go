package codec

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

var floatCodecs = []Codec{FloatBF16, FloatF16, FloatF32, FloatF64}

// special values of each width, as bit patterns: zeros of both signs,
// infinities, quiet and signalling NaNs with payloads, the smallest and
// largest subnormals and normals.
var specials = map[int][]uint64{
	2: {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x0080, 0x7F7F, // bf16
		0x7C00, 0xFC00, 0x7E00, 0x03FF, 0x8001, 0x0400, 0x7BFF}, // fp16
	4: {0, 1 << 31, uint64(math.Float32bits(float32(math.Inf(1)))), uint64(math.Float32bits(float32(math.Inf(-1)))),
		0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF},
	8: {0, 1 << 63, math.Float64bits(math.Inf(1)), math.Float64bits(math.Inf(-1)), 0x7FF8000000000000,
		0xFFF8000000000001, 0x7FF0000000000001, 1, 0x800FFFFFFFFFFFFF, 0x0010000000000000, 0x7FEFFFFFFFFFFFFF},
}

func putElem(b []byte, w int, v uint64) {
	switch w {
	case 2:
		binary.LittleEndian.PutUint16(b, uint16(v))
	case 4:
		binary.LittleEndian.PutUint32(b, uint32(v))
	case 8:
		binary.LittleEndian.PutUint64(b, v)
	}
}

// randomFloats makes n elements of width w mixing the shapes real tensors
// have: trained-weight-like normals, specials, runs of zeros, values
// upcast from a narrower type, and plain noise.
func randomFloats(r *rand.Rand, w, n int) []byte {
	b := make([]byte, n*w)
	scale := math.Pow(10, -r.Float64()*6)
	for i := 0; i < n; i++ {
		var v uint64
		switch r.IntN(10) {
		case 0:
			v = specials[w][r.IntN(len(specials[w]))]
		case 1:
			v = 0
		case 2:
			v = r.Uint64()
		default:
			f := r.NormFloat64() * scale
			switch w {
			case 2:
				v = uint64(math.Float32bits(float32(f)) >> 16)
			case 4:
				v = uint64(math.Float32bits(float32(f)))
			case 8:
				v = math.Float64bits(f)
			}
		}
		if w > 2 && r.IntN(4) == 0 {
			v &^= 1<<(8*w/2) - 1 // upcast: low half zero
		}
		putElem(b[i*w:], w, v)
	}
	return b
}

func roundTrip(t *testing.T, c Codec, src []byte) []byte {
	t.Helper()
	enc, err := Encode(c, nil, src)
	if err != nil {
		t.Fatalf("%s: encode %d bytes: %v", c, len(src), err)
	}
	if bound := MaxEncodedLen(c, len(src)); len(enc) > bound {
		t.Fatalf("%s: %d bytes encoded to %d, over MaxEncodedLen %d", c, len(src), len(enc), bound)
	}
	dec, err := Decode(c, nil, enc, len(src))
	if err != nil {
		t.Fatalf("%s: decode %d bytes: %v", c, len(src), err)
	}
	if !bytes.Equal(dec, src) {
		t.Fatalf("%s: %d bytes do not round-trip", c, len(src))
	}
	return enc
}

// TestFloatRoundTripProperty: for random mixes of values and lengths,
// including odd lengths and several groups, decode(encode(x)) == x.
func TestFloatRoundTripProperty(t *testing.T) {
	r := newRand(42)
	iterations := 300
	if testing.Short() {
		iterations = 60
	}
	for i := range iterations {
		c := floatCodecs[i%len(floatCodecs)]
		w := floatWidth(c)
		n := r.IntN(5000)
		if i%10 == 0 {
			n = floatGroup + r.IntN(2*floatGroup) // several groups
		}
		src := randomFloats(r, w, n)
		src = append(src, randomBytes(r.IntN(w), uint64(i))...) // odd tail
		roundTrip(t, c, src)
	}
}

// TestFloatEdgeInputs covers the lengths and values the property test may
// miss: empty, shorter than one element, group boundaries, specials alone.
func TestFloatEdgeInputs(t *testing.T) {
	for _, c := range floatCodecs {
		w := floatWidth(c)
		for _, n := range []int{0, 1, w - 1, w, w + 1, 7 * w, 8 * w, 16*w + 3, floatGroup * w, floatGroup*w + 1, (floatGroup + 1) * w} {
			roundTrip(t, c, randomFloats(newRand(uint64(n)), w, n/w)[:n/w*w])
			src := append(randomFloats(newRand(uint64(n)), w, n/w), make([]byte, n%w)...)
			roundTrip(t, c, src)
		}
		var sp []byte
		for _, v := range specials[w] {
			e := make([]byte, w)
			putElem(e, w, v)
			sp = append(sp, e...)
		}
		roundTrip(t, c, sp)
		roundTrip(t, c, bytes.Repeat(sp, 1000))
		roundTrip(t, c, nil)
	}
}

// TestFloatCollapse: constant planes cost two bytes a block, so fp32
// holding bf16 values stores at most about half, and zeros almost nothing.
func TestFloatCollapse(t *testing.T) {
	up := normalF32(chunkLen, 31)
	for i := 0; i < len(up); i += 4 {
		up[i], up[i+1] = 0, 0
	}
	enc := roundTrip(t, FloatF32, up)
	bf := roundTrip(t, FloatBF16, normalBF16(chunkLen/2, 31))
	if len(enc) > len(bf)+len(bf)/50 {
		t.Errorf("fp32 upcast from bf16: %d bytes, the bf16 alone %d", len(enc), len(bf))
	}
	for _, c := range floatCodecs {
		if enc := roundTrip(t, c, make([]byte, chunkLen)); len(enc) > 2*floatWidth(c)*chunkLen/floatGroup {
			t.Errorf("%s: %d zero bytes stored in %d", c, chunkLen, len(enc))
		}
	}
}

// TestFloatRuns: zero rows between weights (the Adam state of embeddings
// never looked up) are coded as runs.
func TestFloatRuns(t *testing.T) {
	src := normalF32(chunkLen, 32)
	for row := 0; row < len(src); row += 4096 {
		if row/4096%2 == 0 {
			clear(src[row : row+4096])
		}
	}
	enc := roundTrip(t, FloatF32, src)
	if bytes.Count(enc, []byte{blockRuns}) == 0 || len(enc) > len(src)*6/10 {
		t.Errorf("half-zero rows: stored %d of %d bytes", len(enc), len(src))
	}
}

// TestFloatRatio guards the point of the codec on weight-like data: at
// least what zstd gets, and about what ZipNN reports.
func TestFloatRatio(t *testing.T) {
	for _, tc := range []struct {
		c    Codec
		src  []byte
		want float64
	}{{FloatBF16, normalBF16(chunkLen, 33), 1.45}, {FloatF32, normalF32(chunkLen, 34), 1.17}} {
		enc := roundTrip(t, tc.c, tc.src)
		z, _ := Encode(Zstd, nil, tc.src)
		got := float64(len(tc.src)) / float64(len(enc))
		if got < tc.want || len(enc) >= len(z) {
			t.Errorf("%s: ratio %.3f (zstd %.3f), want >= %.2f and better than zstd", tc.c, got, float64(len(tc.src))/float64(len(z)), tc.want)
		}
	}
}

// TestFloatDecodeDamaged: every way of breaking the framing is ErrCorrupt.
func TestFloatDecodeDamaged(t *testing.T) {
	for _, c := range floatCodecs {
		src := randomFloats(newRand(5), floatWidth(c), 70000)
		src = append(src, 1) // a tail
		enc := roundTrip(t, c, src)
		cases := map[string][]byte{
			"empty":     nil,
			"truncated": enc[:len(enc)-2],
			"half":      enc[:len(enc)/2],
			"trailing":  append(bytes.Clone(enc[:len(enc)-1]), 0xde, enc[len(enc)-1]),
			"bad kind":  append([]byte{9}, enc[1:]...),
		}
		for name, bad := range cases {
			if _, err := Decode(c, nil, bad, len(src)); !errors.Is(err, ErrCorrupt) {
				t.Errorf("%s/%s: error %v, want ErrCorrupt", c, name, err)
			}
		}
		// Flipping bytes anywhere may decode to other bytes (the hash
		// catches that) but must not panic or escape ErrCorrupt.
		for i := 0; i < len(enc); i += len(enc)/64 + 1 {
			bad := bytes.Clone(enc)
			bad[i] ^= 0x5a
			if _, err := Decode(c, nil, bad, len(src)); err != nil && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s: flip at %d: %v", c, i, err)
			}
		}
	}
}

// TestFloatHostileSizes: stored bytes that cannot hold the raw length are
// refused before anything of that size is allocated.
func TestFloatHostileSizes(t *testing.T) {
	for _, c := range floatCodecs {
		small, _ := Encode(c, nil, make([]byte, 1024))
		for _, rawLen := range []int{MaxChunkLen, 1 << 28, 4 << 20} {
			n, err := measureDecode(t, c, small, rawLen)
			if !errors.Is(err, ErrCorrupt) {
				t.Errorf("%s rawLen %d: error %v, want ErrCorrupt", c, rawLen, err)
			}
			if n > allocSlack {
				t.Errorf("%s rawLen %d: allocated %d bytes for a %d byte chunk", c, rawLen, n, len(small))
			}
		}
		// Valid framing claiming a run longer than the block.
		hostile := []byte{blockRuns, 3, 0xff, 0x7f, 0}
		if _, err := Decode(c, nil, append(hostile, bytes.Repeat([]byte{blockConst, 0}, floatWidth(c)-1)...), floatWidth(c)*100); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: overlong run: %v", c, err)
		}
	}
}

// TestFloatEncodeDeterministic: the same input always encodes the same
// way, whatever the pooled scratch held before.
func TestFloatEncodeDeterministic(t *testing.T) {
	a := normalBF16(1<<20, 35)
	b := normalF32(1<<20, 36)
	first, _ := Encode(FloatBF16, nil, a)
	Encode(FloatF32, nil, b)
	Encode(FloatBF16, nil, make([]byte, 1<<20))
	again, _ := Encode(FloatBF16, nil, a)
	if !bytes.Equal(first, again) {
		t.Fatal("encoding changed with the scratch's history")
	}
}

func TestParseSetting(t *testing.T) {
	for _, s := range []string{"auto", "zstd", "none", "float-bf16", "float-f64"} {
		if c, err := ParseSetting(s); err != nil || string(c) != s {
			t.Errorf("ParseSetting(%q) = %q, %v", s, c, err)
		}
	}
	if _, err := Parse("auto"); !errors.Is(err, ErrUnknownCodec) {
		t.Errorf("Parse(auto) = %v: auto is not a stored codec", err)
	}
	if _, err := ParseSetting("float"); !errors.Is(err, ErrUnknownCodec) {
		t.Errorf("ParseSetting(float): %v", err)
	}
}

// FuzzFloatRoundTrip: any bytes, under any float codec, round-trip.
func FuzzFloatRoundTrip(f *testing.F) {
	f.Add(byte(0), []byte{})
	f.Add(byte(1), []byte{0x80, 0xbf, 0x00})
	f.Add(byte(2), normalF32(256, 40)) // small seeds: minimizing big ones takes the whole fuzz time
	f.Add(byte(3), bytes.Repeat([]byte{0, 0, 0, 0, 0, 0, 0xf0, 0x3f}, 40))
	f.Fuzz(func(t *testing.T, sel byte, src []byte) {
		roundTrip(t, floatCodecs[int(sel)%len(floatCodecs)], src)
	})
}

func BenchmarkFloatBlocks(b *testing.B) {
	for _, tc := range []struct {
		name string
		src  []byte
	}{{"zeros", make([]byte, chunkLen)}, {"noise", randomBytes(chunkLen, 9)}} {
		b.Run(tc.name, func(b *testing.B) {
			dst := make([]byte, 0, MaxEncodedLen(FloatF32, len(tc.src)))
			b.SetBytes(int64(len(tc.src)))
			for b.Loop() {
				if _, err := Encode(FloatF32, dst, tc.src); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func ExampleEncode_float() {
	src := make([]byte, 8)
	for i, f := range []float32{1, -1} {
		binary.LittleEndian.PutUint32(src[4*i:], math.Float32bits(f))
	}
	enc, _ := Encode(FloatF32, nil, src)
	fmt.Printf("% x\n", enc)
	// Output: 01 7f 00 00 01 01 00 01 00
}

// FuzzFloatDecode is FuzzDecode aimed at the float format: seeded with the
// golden vectors (every block kind) and with raw lengths near the true one,
// where the framing checks matter most.
func FuzzFloatDecode(f *testing.F) {
	for _, g := range goldenVectors() {
		if len(g.raw) > 8<<10 {
			continue
		}
		enc, err := Encode(g.c, nil, g.raw)
		if err != nil {
			f.Fatal(err)
		}
		sel := byte(slices.Index(floatCodecs, g.c))
		f.Add(sel, uint32(len(g.raw)), enc)
		f.Add(sel, uint32(len(g.raw)+1), enc)
	}
	f.Fuzz(func(t *testing.T, sel byte, raw uint32, src []byte) {
		c := floatCodecs[int(sel)%len(floatCodecs)]
		rawLen := int(raw % (4 << 20))
		before := heapAllocated()
		out, err := Decode(c, nil, src, rawLen)
		if grew := heapAllocated() - before; grew > uint64(rawLen)+allocSlack {
			t.Fatalf("%s: allocated %d bytes for rawLen %d", c, grew, rawLen)
		}
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s: error %v does not wrap ErrCorrupt", c, err)
			}
			return
		}
		if len(out) != rawLen {
			t.Fatalf("%s: %d bytes for rawLen %d", c, len(out), rawLen)
		}
		// What decodes re-encodes to something that decodes the same.
		roundTrip(t, c, out)
	})
}
