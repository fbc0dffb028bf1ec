package dtype

import (
	"strings"
	"testing"
)

func TestEveryDTypeParsesAndHasASize(t *testing.T) {
	seen := map[DType]bool{}
	for _, d := range All() {
		if seen[d] {
			t.Fatalf("%s listed twice", d)
		}
		seen[d] = true
		got, err := Parse(string(d))
		if err != nil || got != d {
			t.Fatalf("Parse(%q) = %q, %v", d, got, err)
		}
		if s := d.Size(); s != 1 && s != 2 && s != 4 && s != 8 && s != 16 {
			t.Errorf("%s: size %d", d, s)
		}
	}
	// The widths torch gives the elements of the types added for it.
	for d, size := range map[DType]int{
		Complex128: 16, Complex32: 4, BComplex32: 4, F8E4M3FNUZ: 1, F8E5M2FNUZ: 1, F8E8M0: 1,
		F4X2: 1, Bits16: 2, Bits8: 1, Bits4x2: 1, UInt4: 1, Int7: 1,
	} {
		if d.Size() != size {
			t.Errorf("%s: size %d, want %d", d, d.Size(), size)
		}
	}
	if len(All()) != 42 {
		t.Errorf("%d dtypes; a new one needs its name here, in the Python client and in the docs", len(All()))
	}
}

func TestParseRefusesOthersNamingWhatItAccepts(t *testing.T) {
	for _, s := range []string{"", "F4", "f32", "C256", "UINT8", "BITS32", " F32"} {
		_, err := Parse(s)
		if err == nil {
			t.Fatalf("Parse(%q) accepted", s)
		}
		for _, d := range All() {
			if !strings.Contains(err.Error(), " "+string(d)) {
				t.Fatalf("Parse(%q): %v does not name %s", s, err, d)
			}
		}
	}
}

func TestNumBytes(t *testing.T) {
	for _, tc := range []struct {
		d     DType
		shape []int64
		want  int64
	}{
		{Complex128, []int64{3, 2}, 96},
		{Complex128, []int64{}, 16},
		{F4X2, []int64{5}, 5},
		{BComplex32, []int64{0, 7}, 0},
		{Bits16, []int64{4}, 8},
	} {
		if n, err := tc.d.NumBytes(tc.shape); err != nil || n != tc.want {
			t.Errorf("%s%v: %d, %v; want %d", tc.d, tc.shape, n, err, tc.want)
		}
	}
	if _, err := Complex128.NumBytes([]int64{1 << 60}); err == nil {
		t.Error("C128 of 2^60 elements does not overflow")
	}
	if _, err := DType("F4").NumBytes([]int64{2}); err == nil {
		t.Error("an unknown dtype has a size")
	}
}
