package codec

import (
	"bytes"
	"fmt"
	"testing"
)

var floatWidths = []int{2, 4, 8}

func newPlanes(w, k int) *[8][]byte {
	var p [8][]byte
	for i := range w {
		p[i] = make([]byte, k)
	}
	return &p
}

// TestSplitMatchesScalar checks the word-at-a-time loops against the
// one-element-at-a-time reference, for every count around the batch sizes.
func TestSplitMatchesScalar(t *testing.T) {
	for _, w := range floatWidths {
		for k := range 70 {
			src := randomBytes(k*w, uint64(w*1000+k))
			fast, ref := newPlanes(w, k), newPlanes(w, k)
			split(w, src, fast, k)
			splitScalar(w, src, ref, k)
			for p := range w {
				if !bytes.Equal(fast[p], ref[p]) {
					t.Fatalf("w=%d k=%d plane %d: fast %x, reference %x", w, k, p, fast[p], ref[p])
				}
			}
			back := make([]byte, k*w)
			merge(w, back, fast, k)
			if !bytes.Equal(back, src) {
				t.Fatalf("w=%d k=%d: merge(split(x)) != x", w, k)
			}
		}
	}
}

func splitScalar(w int, src []byte, p *[8][]byte, k int) {
	switch w {
	case 2:
		split2Scalar(src, p[0][:k], p[1][:k])
	case 4:
		split4Scalar(src, p[0][:k], p[1][:k], p[2][:k], p[3][:k])
	case 8:
		split8Scalar(src, p, 0, k)
	}
}

// TestPlaneLayout pins what doc.go says a plane holds.
func TestPlaneLayout(t *testing.T) {
	cases := []struct {
		w      int
		elem   []byte // little-endian
		planes []byte // plane 0 first
	}{
		// bf16 -1.0 = 0xBF80: exponent 0x7F, sign to bit 0 of the low byte.
		{2, []byte{0x80, 0xBF}, []byte{0x7F, 0x01}},
		// bf16 +1.0 = 0x3F80
		{2, []byte{0x80, 0x3F}, []byte{0x7F, 0x00}},
		// fp32 -2.5 = 0xC0200000: top half 0xC020 -> 0x8041
		{4, []byte{0x00, 0x00, 0x20, 0xC0}, []byte{0x80, 0x41, 0x00, 0x00}},
		// fp64 -1.0 = 0xBFF0000000000000: top half 0xBFF0 -> 0x7FE1
		{8, []byte{0, 0, 0, 0, 0, 0, 0xF0, 0xBF}, []byte{0x7F, 0xE1, 0, 0, 0, 0, 0, 0}},
	}
	for _, tc := range cases {
		p := newPlanes(tc.w, 1)
		split(tc.w, tc.elem, p, 1)
		for i := range tc.w {
			if p[i][0] != tc.planes[i] {
				t.Errorf("w=%d %x: plane %d = %#x, want %#x", tc.w, tc.elem, i, p[i][0], tc.planes[i])
			}
		}
	}
}

func BenchmarkSplit(b *testing.B) {
	for _, w := range floatWidths {
		src := randomBytes(floatGroup*w, 1)
		p := newPlanes(w, floatGroup)
		b.Run(fmt.Sprintf("w%d", w), func(b *testing.B) {
			b.SetBytes(int64(len(src)))
			for b.Loop() {
				split(w, src, p, floatGroup)
			}
		})
	}
}

func BenchmarkMerge(b *testing.B) {
	for _, w := range floatWidths {
		dst := make([]byte, floatGroup*w)
		p := newPlanes(w, floatGroup)
		b.Run(fmt.Sprintf("w%d", w), func(b *testing.B) {
			b.SetBytes(int64(len(dst)))
			for b.Loop() {
				merge(w, dst, p, floatGroup)
			}
		})
	}
}
