package codec

import (
	"errors"
	"fmt"
)

// Codec names how a chunk's bytes are compressed. The string is what
// manifests store; see the package documentation for each format.
type Codec string

// The known codecs.
const (
	None Codec = "none"
	Zstd Codec = "zstd"
	LZ4  Codec = "lz4"
)

// MaxChunkLen is the largest raw chunk Encode and Decode accept. It bounds
// what a decoder allocates for a raw length read from an untrusted manifest.
const MaxChunkLen = 1 << 30

// ErrCorrupt is wrapped by every Decode error caused by the stored bytes or
// the raw length not matching each other.
var ErrCorrupt = errors.New("corrupt chunk")

// ErrUnknownCodec is wrapped by errors about a codec name ckptd does not know.
var ErrUnknownCodec = errors.New("unknown codec")

// Parse returns the Codec named s.
func Parse(s string) (Codec, error) {
	switch c := Codec(s); c {
	case None, Zstd, LZ4:
		return c, nil
	}
	return "", fmt.Errorf("%w %q (want one of %q, %q, %q)", ErrUnknownCodec, s, None, Zstd, LZ4)
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
	return max(n, zstdBound(n), lz4Bound(n))
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
