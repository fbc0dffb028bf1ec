package codec

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
)

// Test inputs that look like what the drain sees: weights are roughly
// normal with a small standard deviation, stored as float32 or bfloat16.

const chunkLen = 4 << 20

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)) }

func normalF32(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n&^3)
	for i := 0; i < len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
	}
	return b
}

func normalBF16(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n&^1)
	for i := 0; i < len(b); i += 2 {
		// bfloat16 is the top half of a float32 (truncated here; rounding
		// would not change the byte statistics).
		bits := math.Float32bits(float32(r.NormFloat64() * 0.02))
		binary.LittleEndian.PutUint16(b[i:], uint16(bits>>16))
	}
	return b
}

func randomBytes(n int, seed uint64) []byte {
	r := newRand(seed)
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// textLike compresses well under every codec, which exercises long matches.
func textLike(n int) []byte {
	const s = "the quick brown fox jumps over the lazy dog; "
	b := make([]byte, n)
	for i := range b {
		b[i] = s[i%len(s)] + byte(i/4096%3)
	}
	return b
}

var allCodecs = []Codec{None, Zstd, LZ4, FloatBF16, FloatF16, FloatF32, FloatF64}
