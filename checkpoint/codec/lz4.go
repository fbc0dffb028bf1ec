package codec

import (
	"errors"
	"fmt"
	"sync"

	"github.com/pierrec/lz4/v4"
)

// lz4Compressors pools the 136 KiB hash tables; sync.Pool is fine here
// because a table is cheap to rebuild after a garbage collection.
var lz4Compressors = sync.Pool{New: func() any { return new(lz4.Compressor) }}

func lz4Bound(n int) int { return lz4.CompressBlockBound(n) }

// lz4Expansion is the most raw bytes one stored byte can stand for: each
// 0xFF length-extension byte adds 255 bytes of match.
const lz4Expansion = 255

func encodeLZ4(dst, src []byte) ([]byte, error) {
	c := lz4Compressors.Get().(*lz4.Compressor)
	defer lz4Compressors.Put(c)
	// With room for CompressBlockBound the block always fits, so n == 0 or
	// an error would be a bug in the library, not a property of src.
	n, err := c.CompressBlock(src, dst[:lz4Bound(len(src))])
	if err == nil && n == 0 {
		err = errors.New("compressor wrote nothing")
	}
	if err != nil {
		return nil, fmt.Errorf("codec: lz4 encode: %w", err)
	}
	return dst[:n], nil
}

func decodeLZ4(dst, src []byte, rawLen int) ([]byte, error) {
	if uint64(rawLen) > uint64(len(src))*lz4Expansion+16 {
		return nil, fmt.Errorf("%w: lz4: %d stored bytes cannot hold %d raw bytes", ErrCorrupt, len(src), rawLen)
	}
	// Exactly rawLen bytes of room: a block that decodes to more fails
	// inside the decoder instead of growing the buffer.
	out := sized(dst, rawLen)[:rawLen]
	if out == nil {
		// pierrec/lz4 v4.1.33's amd64 decoder computes "end of dst - 32"
		// and wraps around when dst's pointer is nil, then writes through
		// it: give it a real (zero-length) array instead.
		out = []byte{}
	}
	n, err := lz4.UncompressBlock(src, out)
	if err != nil {
		return nil, corrupt(LZ4, err)
	}
	if n != rawLen {
		return nil, lengthMismatch(LZ4, n, rawLen)
	}
	return out, nil
}
