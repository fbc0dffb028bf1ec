package codec

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Codec names how a chunk's bytes are compressed. The string is what
// manifests store; see the package documentation for each format.
type Codec string

// The general-purpose codecs; the float-aware ones are in float.go.
const (
	None Codec = "none"
	Zstd Codec = "zstd"
	LZ4  Codec = "lz4"
)

// Auto is a writer setting, never a stored codec: pick one per chunk from
// its dtype and the measured drain rates (see Selector).
const Auto Codec = "auto"

// stored lists every codec a manifest may name, in the order error
// messages give them.
var stored = []Codec{None, Zstd, LZ4, FloatBF16, FloatF16, FloatF32, FloatF64}

// MaxChunkLen is the largest raw chunk Encode and Decode accept. It bounds
// what a decoder allocates for a raw length read from an untrusted manifest.
const MaxChunkLen = 1 << 30

// ErrCorrupt is wrapped by every Decode error caused by the stored bytes or
// the raw length not matching each other.
var ErrCorrupt = errors.New("corrupt chunk")

// ErrUnknownCodec is wrapped by errors about a codec name ckptd does not know.
var ErrUnknownCodec = errors.New("unknown codec")

// Parse returns the stored codec named s (not Auto: a manifest records
// what a chunk was written with).
func Parse(s string) (Codec, error) {
	if slices.Contains(stored, Codec(s)) {
		return Codec(s), nil
	}
	return "", fmt.Errorf("%w %q (want one of %s)", ErrUnknownCodec, s, quoted(stored))
}

// ParseSetting returns the codec setting named s: Auto or a stored codec.
func ParseSetting(s string) (Codec, error) {
	if Codec(s) == Auto {
		return Auto, nil
	}
	if _, err := Parse(s); err != nil {
		return "", fmt.Errorf("%w %q (want %q or one of %s)", ErrUnknownCodec, s, Auto, quoted(stored))
	}
	return Codec(s), nil
}

func quoted(cs []Codec) string {
	q := make([]string, len(cs))
	for i, c := range cs {
		q[i] = strconv.Quote(string(c))
	}
	return strings.Join(q, ", ")
}

// MaxEncodedLen returns how many bytes Encode may need for n raw bytes.
// A dst with at least this capacity makes Encode allocation-free. For an
// unknown codec it returns the largest bound of any codec.
func MaxEncodedLen(c Codec, n int) int {
	switch c {
	case None:
		return n
	case Zstd:
		return zstdBound(n)
	case LZ4:
		return lz4Bound(n)
	}
	if w := floatWidth(c); w > 0 {
		return floatBound(w, n)
	}
	return max(n, zstdBound(n), lz4Bound(n), floatBound(2, n), floatBound(4, n), floatBound(8, n))
}

// Encode compresses src with c and returns the stored bytes, appended to
// dst[:0]. It allocates a new buffer only when cap(dst) is below
// MaxEncodedLen(c, len(src)). dst must not overlap src. Safe for concurrent
// use.
func Encode(c Codec, dst, src []byte) ([]byte, error) {
	if len(src) > MaxChunkLen {
		return nil, fmt.Errorf("codec: chunk of %d bytes exceeds the %d byte limit", len(src), MaxChunkLen)
	}
	switch c {
	case None:
		return append(dst[:0], src...), nil
	case Zstd:
		return encodeZstd(sized(dst, zstdBound(len(src))), src)
	case LZ4:
		return encodeLZ4(sized(dst, lz4Bound(len(src))), src)
	}
	if w := floatWidth(c); w > 0 {
		return encodeFloat(w, sized(dst, floatBound(w, len(src))), src)
	}
	_, err := Parse(string(c))
	return nil, fmt.Errorf("codec: encode: %w", err)
}

// Decode decompresses src, the stored bytes of a chunk written with c, and
// returns exactly rawLen bytes in dst[:0], reusing dst when cap(dst) >=
// rawLen. src is untrusted: when it does not decode to exactly rawLen bytes
// the error wraps ErrCorrupt, and Decode never allocates much more than
// rawLen whatever src claims. dst must not overlap src. Safe for concurrent
// use.
func Decode(c Codec, dst, src []byte, rawLen int) ([]byte, error) {
	if rawLen < 0 || rawLen > MaxChunkLen {
		return nil, fmt.Errorf("%w: raw length %d outside [0, %d]", ErrCorrupt, rawLen, MaxChunkLen)
	}
	switch c {
	case None:
		return decodeNone(dst, src, rawLen)
	case Zstd:
		return decodeZstd(dst, src, rawLen)
	case LZ4:
		return decodeLZ4(dst, src, rawLen)
	}
	if w := floatWidth(c); w > 0 {
		return decodeFloat(c, w, dst, src, rawLen)
	}
	_, err := Parse(string(c))
	return nil, fmt.Errorf("codec: decode: %w", err)
}

func decodeNone(dst, src []byte, rawLen int) ([]byte, error) {
	if len(src) != rawLen {
		return nil, fmt.Errorf("%w: none: %d stored bytes, want %d", ErrCorrupt, len(src), rawLen)
	}
	return append(sized(dst, rawLen), src...), nil
}

// sized returns dst[:0] when it can hold n bytes, else a new buffer that can.
func sized(dst []byte, n int) []byte { return reuseOr(dst, n, n) }

// reuseOr returns dst[:0] when it can hold n bytes, else a new buffer of
// capacity alloc.
func reuseOr(dst []byte, n, alloc int) []byte {
	if cap(dst) >= n {
		return dst[:0]
	}
	return make([]byte, 0, alloc)
}

// corrupt wraps a decoder's error so callers can test for ErrCorrupt while
// the message keeps the decoder's reason.
func corrupt(c Codec, err error) error {
	return fmt.Errorf("%w: %s: %w", ErrCorrupt, c, err)
}

// lengthMismatch reports a chunk that decoded cleanly to the wrong length.
func lengthMismatch(c Codec, got, want int) error {
	return fmt.Errorf("%w: %s: decoded %d bytes, want %d", ErrCorrupt, c, got, want)
}
