package safetensors

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// TestEveryCkptdDTypeGoesIntoAFile: each ckptd dtype is written under one
// of the format's dtypes, with a shape that spans the same bytes, so a
// file ckptd writes never names a dtype the reference library refuses.
func TestEveryCkptdDTypeGoesIntoAFile(t *testing.T) {
	for _, d := range dtype.All() {
		for _, shape := range [][]int64{{}, {3}, {2, 5}, {4, 0}} {
			want, err := d.NumBytes(shape)
			if err != nil {
				t.Fatal(err)
			}
			st, stShape, own := Stored(d, shape)
			got, err := numBytes(st, stShape)
			if err != nil || got != want {
				t.Fatalf("%s%v is stored as %s%v: %d bytes, %v; want %d", d, shape, st, stShape, got, err, want)
			}
			if own != (st == d || d == dtype.F4X2) {
				t.Errorf("%s is stored as %s, own = %v", d, st, own)
			}
			if own && d != dtype.F4X2 && !slices.Equal(stShape, shape) {
				t.Errorf("%s%v: stored shape %v", d, shape, stShape)
			}
		}
	}
	for _, tc := range []struct {
		d     dtype.DType
		shape []int64
		st    dtype.DType
		want  []int64
	}{
		{dtype.F4X2, []int64{3, 4}, "F4", []int64{3, 8}},
		{dtype.F4X2, []int64{}, "F4", []int64{2}},
		{dtype.Complex128, []int64{3}, dtype.F64, []int64{3, 2}},
		{dtype.Complex32, []int64{}, dtype.F16, []int64{2}},
		{dtype.BComplex32, []int64{1, 2}, dtype.BF16, []int64{1, 2, 2}},
		{dtype.Bits16, []int64{5}, dtype.U16, []int64{5}},
		{dtype.UInt4, []int64{5}, dtype.U8, []int64{5}},
		{dtype.F8E8M0, []int64{5}, dtype.F8E8M0, []int64{5}},
		{dtype.F8E4M3FNUZ, []int64{5}, dtype.F8E4M3FNUZ, []int64{5}},
	} {
		st, shape, _ := Stored(tc.d, tc.shape)
		if st != tc.st || !slices.Equal(shape, tc.want) {
			t.Errorf("Stored(%s, %v) = %s %v, want %s %v", tc.d, tc.shape, st, shape, tc.st, tc.want)
		}
	}
}

func TestForFileNamesTheTensorsStoredAsAnother(t *testing.T) {
	table := []Tensor{
		{Name: "a", DType: dtype.F32, Shape: []int64{2}, Begin: 0, End: 8},
		{Name: "z", DType: dtype.Complex128, Shape: []int64{1}, Begin: 8, End: 24},
		{Name: "f", DType: dtype.F4X2, Shape: []int64{3}, Begin: 24, End: 27},
		{Name: "b", DType: dtype.Bits8, Shape: []int64{1}, Begin: 27, End: 28},
	}
	meta := map[string]string{"format": "pt"}
	out, m := ForFile(table, meta)
	if len(meta) != 1 {
		t.Fatal("ForFile changed the caller's metadata")
	}
	var named map[string]string
	if err := json.Unmarshal([]byte(m[MetadataDTypes]), &named); err != nil || m["format"] != "pt" {
		t.Fatalf("metadata %v: %v", m, err)
	}
	if want := map[string]string{"z": "C128", "b": "BITS8"}; !sameMap(named, want) {
		t.Errorf("%s = %v, want %v", MetadataDTypes, named, want)
	}
	header, err := EncodeHeader(out, m)
	if err != nil {
		t.Fatal(err)
	}
	file := append(header, make([]byte, 28)...)
	parsed, pm, _, err := parseBytes(file)
	if err != nil || pm[MetadataDTypes] != m[MetadataDTypes] {
		t.Fatalf("parse: %v, %v", pm, err)
	}
	for _, p := range parsed {
		if p.Name == "f" && (p.DType != "F4" || !slices.Equal(p.Shape, []int64{6})) {
			t.Errorf("f: %s %v", p.DType, p.Shape)
		}
	}
	if out, m := ForFile(table[:1], nil); m != nil || out[0].DType != dtype.F32 {
		t.Errorf("a table of the format's own dtypes: %v, metadata %v", out, m)
	}
}

func sameMap(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestSubByteDTypesFillWholeBytes(t *testing.T) {
	for _, tc := range []struct {
		json string
		ok   bool
	}{
		{`{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}`, true},
		{`{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}`, false},
		{`{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}`, true},
		{`{"a":{"dtype":"F6_E3M2","shape":[2],"data_offsets":[0,2]}}`, false},
		{`{"a":{"dtype":"F8_E8M0","shape":[3],"data_offsets":[0,3]}}`, true},
		{`{"a":{"dtype":"C128","shape":[1],"data_offsets":[0,16]}}`, false}, // ckptd's name, not the format's
	} {
		var end int
		var v map[string]struct {
			Offsets []int `json:"data_offsets"`
		}
		if err := json.Unmarshal([]byte(tc.json), &v); err != nil {
			t.Fatal(err)
		}
		end = v["a"].Offsets[1]
		_, _, _, err := parseBytes(header(tc.json, end))
		if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ok = %v", tc.json, err, tc.ok)
		}
	}
}
