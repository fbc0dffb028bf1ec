package codec

import (
	"bytes"
	"testing"
)

// FuzzDecode feeds Decode arbitrary stored bytes and raw lengths. Decode
// must not panic, must return exactly rawLen bytes when it succeeds, and
// must not allocate much beyond rawLen whatever the bytes claim.
func FuzzDecode(f *testing.F) {
	for i, src := range [][]byte{nil, {7}, []byte("hello, hello, hello, hello"), textLike(3000), normalBF16(4096, 11), make([]byte, 5000)} {
		for j, c := range allCodecs {
			enc, err := Encode(c, nil, src)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(byte(j), uint32(len(src)), enc)
			if i == 2 {
				f.Add(byte(j), uint32(len(src)+1), enc)
			}
		}
	}
	f.Fuzz(func(t *testing.T, sel byte, raw uint32, src []byte) {
		c := allCodecs[int(sel)%len(allCodecs)]
		rawLen := int(raw % (8 << 20))
		before := heapAllocated()
		out, err := Decode(c, nil, src, rawLen)
		if grew := heapAllocated() - before; grew > uint64(rawLen)+allocSlack {
			t.Fatalf("%s: allocated %d bytes for rawLen %d", c, grew, rawLen)
		}
		if err != nil {
			return
		}
		if len(out) != rawLen || cap(out) > max(rawLen, zstdDecodeCap(rawLen)) {
			t.Fatalf("%s: got len %d cap %d for rawLen %d", c, len(out), cap(out), rawLen)
		}
		// Decoding into a reused buffer must give the same bytes.
		again, err := Decode(c, make([]byte, 0, rawLen), src, rawLen)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("%s: second decode differs: %v", c, err)
		}
	})
}
