package codec

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Golden vectors pin the float format: bytes written by this version must
// decode to the same values forever, so every vector's stored bytes (or,
// for the big ones, their length and hash) live in testdata. Inputs come
// from integer arithmetic only (no math/rand, no float rounding), so they
// cannot drift either.
//
// If the encoder's output changes on purpose (or a klauspost/compress
// upgrade builds Huffman tables differently), the decode half must still
// pass; then regenerate with: go test ./checkpoint/codec -run Golden -update

var update = flag.Bool("update", false, "rewrite the golden vectors in testdata")

const goldenFile = "testdata/float-golden.txt"

// xorshift is a fixed generator for golden inputs.
type xorshift uint64

func (x *xorshift) next() uint64 {
	*x ^= *x << 13
	*x ^= *x >> 7
	*x ^= *x << 17
	return uint64(*x)
}

// weightBits returns the top 16 bits of a float32 that looks like a trained
// weight: random sign and mantissa, exponent 2^-6 and below with the
// halving frequencies of a normal distribution's tail.
func (x *xorshift) weightBits() uint16 {
	r := x.next()
	exp := uint16(121)
	for r&1 == 1 && exp > 100 {
		exp--
		r >>= 1
	}
	return uint16(r>>20)&0x8000 | exp<<7 | uint16(r>>40)&0x7F
}

type golden struct {
	name string
	c    Codec
	raw  []byte
}

func goldenVectors() []golden {
	var out []golden
	x := xorshift(0x9E3779B97F4A7C15)
	elems := func(w, n int, f func(i int) uint64) []byte {
		b := make([]byte, w*n)
		for i := range n {
			putElem(b[w*i:], w, f(i))
		}
		return b
	}
	var sp []byte
	for _, v := range specials[2] {
		sp = binary.LittleEndian.AppendUint16(sp, uint16(v))
	}
	out = append(out,
		golden{"empty", FloatBF16, nil},
		golden{"tail-only", FloatF32, []byte{1, 2, 3}},
		golden{"bf16-specials", FloatBF16, sp},
		golden{"f16-specials+tail", FloatF16, append(bytes.Clone(sp), 0xAB)},
		golden{"bf16-weights", FloatBF16, elems(2, 3000, func(int) uint64 { return uint64(x.weightBits()) })},
		golden{"f32-weights", FloatF32, elems(4, 1500, func(int) uint64 { return uint64(x.weightBits())<<16 | x.next()&0xFFFF })},
		golden{"f32-upcast", FloatF32, elems(4, 1500, func(int) uint64 { return uint64(x.weightBits()) << 16 })},
		golden{"f32-zero-rows", FloatF32, elems(4, 2048, func(i int) uint64 {
			if i/256%2 == 0 {
				return 0
			}
			return uint64(x.weightBits())<<16 | x.next()&0xFFFF
		})},
		golden{"f64-weights+tail", FloatF64, append(elems(8, 300, func(int) uint64 {
			h := uint64(x.weightBits())
			exp := h>>7&0xFF - 127 + 1023 // rebias the exponent for fp64
			return h>>15<<63 | exp<<52 | x.next()&(1<<52-1)
		}), 5, 4, 3, 2, 1)},
		// Several groups: stored as length and hash only.
		golden{"bf16-groups", FloatBF16, elems(2, 2*floatGroup+77, func(int) uint64 { return uint64(x.weightBits()) })},
	)
	return out
}

// goldenLine is how one vector's stored bytes are recorded: hex when
// small, else length and hash.
func goldenLine(g golden, stored []byte) string {
	if len(stored) <= 4096 {
		return fmt.Sprintf("%s %s hex:%x", g.name, g.c, stored)
	}
	return fmt.Sprintf("%s %s len:%d %s", g.name, g.c, len(stored), FormatHash(Hash(stored)))
}

func TestFloatGolden(t *testing.T) {
	vectors := goldenVectors()
	if *update {
		writeGolden(t, vectors)
	}
	want := readGolden(t)
	for _, g := range vectors {
		line, ok := want[g.name]
		if !ok {
			t.Errorf("%s: no golden vector (run with -update)", g.name)
			continue
		}
		// Decoding the recorded bytes is the compatibility promise.
		if h, found := strings.CutPrefix(strings.Fields(line)[2], "hex:"); found {
			stored, err := hex.DecodeString(h)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Decode(g.c, nil, stored, len(g.raw))
			if err != nil || !bytes.Equal(got, g.raw) {
				t.Errorf("%s: recorded bytes no longer decode to the input: %v", g.name, err)
			}
		}
		// Encoding the same way keeps stored objects stable across
		// versions (and incremental checkpoints deduplicating).
		enc, err := Encode(g.c, nil, g.raw)
		if err != nil {
			t.Fatal(err)
		}
		if got := goldenLine(g, enc); got != line {
			t.Errorf("%s: encoding changed:\n got %.200s\nwant %.200s", g.name, got, line)
		}
		if dec, err := Decode(g.c, nil, enc, len(g.raw)); err != nil || !bytes.Equal(dec, g.raw) {
			t.Errorf("%s: round trip: %v", g.name, err)
		}
	}
}

// TestFloatGoldenUsesEveryBlockKind keeps the vectors meaningful: together
// they must exercise every block kind.
func TestFloatGoldenUsesEveryBlockKind(t *testing.T) {
	seen := map[byte]bool{}
	for _, g := range goldenVectors() {
		enc, _ := Encode(g.c, nil, g.raw)
		w := floatWidth(g.c)
		n := len(g.raw) / w
		body := enc[:len(enc)-len(g.raw)%w]
		for grp := 0; grp < n; grp += floatGroup {
			for range w {
				size, err := blockSize(body, min(floatGroup, n-grp))
				if err != nil {
					t.Fatalf("%s: %v", g.name, err)
				}
				seen[body[0]] = true
				body = body[size:]
			}
		}
	}
	for _, k := range []byte{blockRaw, blockConst, blockHuff, blockRuns} {
		if !seen[k] {
			t.Errorf("no golden vector has a block of kind %d", k)
		}
	}
}

func writeGolden(t *testing.T, vectors []golden) {
	var b strings.Builder
	b.WriteString("# Golden vectors of the float codecs: name codec stored-bytes. See float_golden_test.go.\n")
	for _, g := range vectors {
		enc, err := Encode(g.c, nil, g.raw)
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString(goldenLine(g, enc) + "\n")
	}
	if err := os.MkdirAll(filepath.Dir(goldenFile), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(goldenFile, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readGolden(t *testing.T) map[string]string {
	f, err := os.Open(goldenFile)
	if err != nil {
		t.Fatalf("%v (generate with -update)", err)
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		out[strings.Fields(line)[0]] = line
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
