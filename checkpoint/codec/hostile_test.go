package codec

import (
	"bytes"
	"errors"
	"runtime/metrics"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// heapAllocated returns the bytes allocated on the heap so far. Small
// allocations are counted a span at a time, so differences are exact only
// to within some tens of KiB, which is plenty to catch a decoder that
// believes a size a hostile header declares.
func heapAllocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// allocSlack is what Decode may allocate beyond rawLen: decoder state
// created on first use and the per-block scratch the zstd decoder keeps.
const allocSlack = 1 << 20

func measureDecode(t *testing.T, c Codec, src []byte, rawLen int) (uint64, error) {
	t.Helper()
	Decode(c, nil, src, rawLen) // warm the decoder pools
	before := heapAllocated()
	_, err := Decode(c, nil, src, rawLen)
	return heapAllocated() - before, err
}

// streamedZeros is a zstd frame without a content size that expands to n
// zero bytes, as a streaming writer makes it.
func streamedZeros(t *testing.T, n int) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := zstd.NewWriter(&buf, zstd.WithEncoderCRC(false))
	if err != nil {
		t.Fatal(err)
	}
	w.Write(make([]byte, n))
	w.Close()
	return buf.Bytes()
}

// withHeader replaces the frame header of a single-frame src with h.
func withHeader(t *testing.T, src []byte, h zstd.Header) []byte {
	t.Helper()
	var old zstd.Header
	body, err := old.DecodeAndStrip(src)
	if err != nil {
		t.Fatal(err)
	}
	out, err := h.AppendTo(nil)
	if err != nil {
		t.Fatal(err)
	}
	return append(out, body...)
}

func TestZstdHostileSizes(t *testing.T) {
	const rawLen = 1 << 20
	const bigLen = 64 << 20
	stream := streamedZeros(t, bigLen)
	cases := []struct {
		name string
		src  []byte
	}{
		// A content size far beyond rawLen must be refused from the header.
		{"declares 1 TiB", withHeader(t, stream, zstd.Header{WindowSize: 8 << 20, HasFCS: true, FrameContentSize: 1 << 40})},
		// No content size: the decoder must stop at rawLen's capacity.
		{"undeclared 64 MiB", stream},
		// A content size that lies: the blocks hold 64 MiB.
		{"declares rawLen, holds 64 MiB", withHeader(t, stream, zstd.Header{WindowSize: 8 << 20, HasFCS: true, FrameContentSize: rawLen})},
		// A window larger than anything we write.
		{"huge window", withHeader(t, stream, zstd.Header{WindowSize: 1 << 40, HasFCS: false})},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n, err := measureDecode(t, Zstd, tc.src, rawLen)
			if !errors.Is(err, ErrCorrupt) {
				t.Errorf("error %v, want ErrCorrupt", err)
			}
			// What zstdDecodeCap reserves plus small scratch (more
			// under -race, where pools drop items): no reallocation,
			// which would add another ~rawLen.
			if n > uint64(zstdDecodeCap(rawLen))+64<<10 {
				t.Errorf("allocated %d bytes for a %d byte chunk", n, rawLen)
			}
			t.Logf("allocated %d bytes; %v", n, err)
		})
	}
}

// TestHostileRawLen covers a manifest that claims a raw length the stored
// bytes cannot possibly hold: nothing of that size may be allocated.
func TestHostileRawLen(t *testing.T) {
	for _, c := range []Codec{Zstd, LZ4, None} {
		src, _ := Encode(c, nil, []byte("tiny"))
		n, err := measureDecode(t, c, src, MaxChunkLen)
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: error %v, want ErrCorrupt", c, err)
		}
		if n > allocSlack {
			t.Errorf("%s: allocated %d bytes for a %d byte frame", c, n, len(src))
		}
	}
}
