package checkpoint

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

func TestValidateName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"llama-7b", true}, {"model.layers.0.weight", true}, {"a b", true},
		{"", false}, {"a/b", false}, {"..", false}, {"a..b", false}, {".", false},
		{"nul\x00", false}, {"tab\t", false}, {strings.Repeat("x", 255), true}, {strings.Repeat("x", 256), false},
		{"bad\xffutf8", false}, {"__metadata__", true}, // reserved only for tensors
	} {
		err := ValidateName("job", tc.name)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
			t.Errorf("ValidateName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func TestTargetValidate(t *testing.T) {
	for _, tc := range []struct {
		t  Target
		ok bool
	}{
		{Target{"j", 0, 0, 1, "a"}, true},
		{Target{"j", MaxStep, 7, 8, "slurm-123.4_x"}, true},
		{Target{"j", -1, 0, 1, "a"}, false},
		{Target{"j", MaxStep + 1, 0, 1, "a"}, false},
		{Target{"j", 1, 1, 1, "a"}, false},
		{Target{"j", 1, -1, 1, "a"}, false},
		{Target{"j", 1, 0, 0, "a"}, false},
		{Target{"../x", 1, 0, 1, "a"}, false},
		{Target{"j", 0, 0, 1, ""}, false},
		{Target{"j", 0, 0, 1, "Upper"}, false},
		{Target{"j", 0, 0, 1, ".hidden"}, false},
		{Target{"j", 0, 0, 1, ".."}, false},
		{Target{"j", 0, 0, 1, "a/b"}, false},
		{Target{"j", 0, 0, 1, strings.Repeat("a", 64)}, true},
		{Target{"j", 0, 0, 1, strings.Repeat("a", 65)}, false},
	} {
		if err := tc.t.Validate(); (err == nil) != tc.ok {
			t.Errorf("%v.Validate() = %v", tc.t, err)
		}
	}
}

func TestNewLayoutRejects(t *testing.T) {
	f32 := func(name string, off int64, n int64) Tensor {
		return Tensor{Name: name, DType: dtype.F32, Shape: []int64{n}, Offset: off, Length: 4 * n}
	}
	for _, tc := range []struct {
		name string
		ts   []Tensor
		want string
	}{
		{"overlap", []Tensor{f32("a", 0, 10), f32("b", 36, 10)}, "overlaps"},
		{"negative offset", []Tensor{f32("a", -4, 1)}, "negative"},
		{"length mismatch", []Tensor{{Name: "a", DType: dtype.F32, Shape: []int64{3}, Length: 8}}, "needs 12 bytes"},
		{"bad dtype", []Tensor{{Name: "a", DType: "F33", Shape: []int64{1}, Length: 4}}, "unknown dtype"},
		{"duplicate", []Tensor{f32("a", 0, 1), f32("a", 4, 1)}, "twice"},
		{"slash", []Tensor{f32("a/b", 0, 1)}, "contains"},
		{"negative dim", []Tensor{{Name: "a", DType: dtype.F32, Shape: []int64{-1}, Length: 4}}, "negative dimension"},
		{"overflow", []Tensor{{Name: "a", DType: dtype.F64, Shape: []int64{1 << 40, 1 << 40}, Length: 4}}, "overflows"},
		// 2^62 bytes at offset 2^62: the end wraps past int64.
		{"end overflows", []Tensor{{Name: "a", DType: dtype.U8, Shape: []int64{1 << 62}, Offset: 1 << 62, Length: 1 << 62}, {Name: "b", DType: dtype.U8, Shape: []int64{1 << 62}, Offset: 3 << 61, Length: 1 << 62}}, "overflows"},
		{"total overflows", []Tensor{{Name: "a", DType: dtype.U8, Shape: []int64{1<<63 - 1}, Offset: 0, Length: 1<<63 - 1}, {Name: "b", DType: dtype.U8, Shape: []int64{1}, Offset: 1<<63 - 1, Length: 1}}, "overflows"},
		{"reserved name", []Tensor{f32("__metadata__", 0, 1)}, "reserved"},
	} {
		_, err := NewLayout(tc.ts)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrInvalid containing %q", tc.name, err, tc.want)
		}
	}
}

func TestLayoutAndChunks(t *testing.T) {
	ts := []Tensor{
		{Name: "b", DType: dtype.F32, Shape: []int64{3000}, Offset: 12288, Length: 12000}, // after a gap
		{Name: "a", DType: dtype.F32, Shape: []int64{1000}, Offset: 0, Length: 4000},
		{Name: "c", DType: dtype.I64, Shape: []int64{2}, Offset: 24288, Length: 16},
		{Name: "d", DType: dtype.BF16, Shape: []int64{10000}, Offset: 24304, Length: 20000},
	}
	l, err := NewLayout(ts)
	if err != nil {
		t.Fatal(err)
	}
	if l.DataSize != 36016 || l.RegionSize != 44304 || l.Packed[1].Offset != 4000 || l.Packed[0].Name != "a" {
		t.Fatalf("layout %+v", l)
	}
	plan := l.planChunks(8192, 0)
	var raw int64
	for i, c := range plan {
		if c.rawOffset != raw || c.raw > 8192 {
			t.Fatalf("chunk %d: %+v", i, c)
		}
		raw += c.raw
	}
	if raw != l.DataSize {
		t.Fatalf("chunks cover %d of %d", raw, l.DataSize)
	}
	// a+b (f32) then c alone (i64) then d (bf16): dtypes never mix.
	want := []dtype.DType{dtype.F32, dtype.F32, dtype.I64, dtype.BF16, dtype.BF16, dtype.BF16}
	if len(plan) != len(want) {
		t.Fatalf("%d chunks, want %d: %+v", len(plan), len(want), plan)
	}
	for i, c := range plan {
		if c.dtype != want[i] {
			t.Errorf("chunk %d dtype %s, want %s", i, c.dtype, want[i])
		}
	}
	if len(plan[0].spans) != 2 { // a, then the start of b across the gap
		t.Errorf("chunk 0 spans %v", plan[0].spans)
	}
}

// With a threshold, a large tensor has chunks of its own: the small
// tensors between two large ones share theirs, and a change to them leaves
// the large ones' chunks as they were.
func TestChunksOfTheirOwn(t *testing.T) {
	var ts []Tensor
	var off int64
	for _, n := range []int64{10000, 100, 100, 10000, 100} {
		ts = append(ts, Tensor{Name: fmt.Sprintf("t%d", len(ts)), DType: dtype.F32, Shape: []int64{n / 4}, Offset: off, Length: n})
		off += n
	}
	l, err := NewLayout(ts)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		alone int64
		want  []int64
	}{
		{0, []int64{4096, 4096, 4096, 4096, 3916}},
		{1024, []int64{4096, 4096, 1808, 200, 4096, 4096, 1808, 100}},
		{100000, []int64{4096, 4096, 4096, 4096, 3916}},
	} {
		var got []int64
		for _, c := range l.planChunks(4096, tc.alone) {
			got = append(got, c.raw)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("alone %d: chunks %v, want %v", tc.alone, got, tc.want)
		}
	}
}
