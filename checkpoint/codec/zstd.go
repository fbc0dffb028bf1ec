package codec

import (
	"errors"
	"fmt"

	"github.com/klauspost/compress/zstd"
)

// zstdEncoderOptions are the writer's settings, measured with
// BenchmarkZstdSettings on 4 MiB of normal(0, 0.02) float32 and bfloat16:
//   - SpeedFastest: float weights have almost no LZ matches, so every level
//     gives the same ratio (0.926 f32, 0.780 bf16) and only speed differs:
//     ~800 MB/s fastest, ~730 default, ~550 better, per core.
//   - All-literal entropy coding: what actually compresses floats is
//     Huffman-coding the skewed sign/exponent bytes; SpeedFastest skips it
//     by default and then stores everything raw (ratio 1.000).
//   - No CRC: the manifest hash already covers every chunk; it saves 4
//     bytes a frame and costs nothing measurable either way.
//   - Single segment: every frame then declares its content size, which a
//     reader can check against the manifest before decoding anything.
//   - Concurrency 1: an Encoder with more would hand EncodeAll calls to
//     its own pool of per-encoder state (~8 MiB history each, rotated
//     FIFO so all get touched); the free list does that job with LIFO
//     reuse instead.
var zstdEncoderOptions = []zstd.EOption{
	zstd.WithEncoderLevel(zstd.SpeedFastest),
	zstd.WithAllLitEntropyCompression(true),
	zstd.WithEncoderCRC(false),
	zstd.WithSingleSegment(true),
	zstd.WithZeroFrames(true),
	zstd.WithEncoderConcurrency(1),
}

// zstdDecoderOptions make DecodeAll stop at cap(dst) instead of growing it,
// which is what keeps a hostile frame from allocating past the raw length.
var zstdDecoderOptions = []zstd.DOption{
	zstd.WithDecoderConcurrency(1),
	zstd.WithDecodeAllCapLimit(true),
	zstd.WithDecoderMaxMemory(MaxChunkLen + zstdSlack),
}

// zstdSlack is spare capacity for decoded output: the decoder's fast path
// copies up to 32 bytes past the logical end of a block.
const zstdSlack = 64

// zstdMaxBlock is the most one zstd block can regenerate.
const zstdMaxBlock = 128 << 10

var (
	zstdEncoders = freeList[*zstd.Encoder]{fresh: func() (*zstd.Encoder, error) {
		return zstd.NewWriter(nil, zstdEncoderOptions...)
	}}
	zstdDecoders = freeList[*zstd.Decoder]{fresh: func() (*zstd.Decoder, error) {
		return zstd.NewReader(nil, zstdDecoderOptions...)
	}}
)

// zstdBound is ZSTD_COMPRESSBOUND plus room for the frame and block headers
// this encoder writes.
func zstdBound(n int) int {
	b := n + n>>8 + 64
	if n < 128<<10 {
		b += (128<<10 - n) >> 11
	}
	return b
}

// zstdExpansion is the most raw bytes one stored byte can stand for: a
// 4-byte RLE block regenerates at most 128 KiB.
const zstdExpansion = zstdMaxBlock / 4

func encodeZstd(dst, src []byte) ([]byte, error) {
	enc, err := zstdEncoders.get()
	if err != nil {
		return nil, fmt.Errorf("codec: zstd encoder: %w", err)
	}
	defer zstdEncoders.put(enc)
	return enc.EncodeAll(src, dst), nil
}

func decodeZstd(dst, src []byte, rawLen int) ([]byte, error) {
	if err := checkZstdHeader(src, rawLen); err != nil {
		return nil, err
	}
	dec, err := zstdDecoders.get()
	if err != nil {
		return nil, fmt.Errorf("codec: zstd decoder: %w", err)
	}
	defer zstdDecoders.put(dec)
	// A dst between rawLen and zstdDecodeCap is used as is: valid frames
	// fit, and a hostile one costs at most one reallocation of about
	// rawLen + 128 KiB.
	out, err := dec.DecodeAll(src, reuseOr(dst, rawLen, zstdDecodeCap(rawLen)))
	if err != nil {
		return nil, corrupt(Zstd, err)
	}
	if len(out) != rawLen {
		return nil, lengthMismatch(Zstd, len(out), rawLen)
	}
	return out, nil
}

// checkZstdHeader rejects, before anything is allocated, frames that cannot
// decode to rawLen bytes or that use features the format excludes.
func checkZstdHeader(src []byte, rawLen int) error {
	if uint64(rawLen) > uint64(len(src))*zstdExpansion {
		return fmt.Errorf("%w: zstd: %d stored bytes cannot hold %d raw bytes", ErrCorrupt, len(src), rawLen)
	}
	var h zstd.Header
	if err := h.Decode(src); err != nil {
		return corrupt(Zstd, err)
	}
	switch {
	case h.Skippable:
		return corrupt(Zstd, errors.New("skippable frame"))
	case h.DictionaryID != 0:
		return corrupt(Zstd, fmt.Errorf("frame needs dictionary %d", h.DictionaryID))
	case h.HasFCS && h.FrameContentSize != uint64(rawLen):
		return fmt.Errorf("%w: zstd: frame declares %d raw bytes, want %d", ErrCorrupt, h.FrameContentSize, rawLen)
	}
	return nil
}

// zstdDecodeCap is the capacity Decode allocates for rawLen bytes. The
// decoder checks lengths only between blocks, so a frame that lies about
// its size can run one block past rawLen before it is stopped; room for
// that block keeps the decoder from growing the buffer behind our back.
// A block is no larger than the window, which for the single-segment
// frames we write is the content size (at least 1 KiB).
func zstdDecodeCap(rawLen int) int {
	return rawLen + min(max(rawLen, 1<<10), zstdMaxBlock) + zstdSlack
}
