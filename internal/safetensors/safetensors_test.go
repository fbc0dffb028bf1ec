package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

var update = flag.Bool("update", false, "rewrite testdata/golden.safetensors")

// sampleTable covers the awkward cases: a scalar, an empty tensor sharing
// an offset with its neighbour, names that need escaping.
func sampleTable() ([]Tensor, map[string]string) {
	return []Tensor{
			{Name: "embed.weight", DType: dtype.F32, Shape: []int64{2, 2}, Begin: 0, End: 16},
			{Name: "layers.0.bias", DType: dtype.F16, Shape: []int64{3}, Begin: 16, End: 22},
			{Name: "empty", DType: dtype.F64, Shape: []int64{0, 5}, Begin: 22, End: 22},
			{Name: "mask", DType: dtype.Bool, Shape: []int64{2}, Begin: 22, End: 24},
			{Name: "step", DType: dtype.I64, Shape: []int64{}, Begin: 24, End: 32},
			{Name: "odd \"name\"\\é\n", DType: dtype.U8, Shape: []int64{1, 1}, Begin: 32, End: 33},
		}, map[string]string{
			"format": "pt",
			"note":   "quote \" backslash \\ tab \t é",
		}
}

// sampleData is the data section for sampleTable.
func sampleData() []byte {
	var b []byte
	for _, f := range []float32{1, -2, 0.5, 3.25} {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(f))
	}
	b = append(b, 0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38) // F16 1, -2, 0.5
	b = append(b, 1, 0)                               // BOOL true, false
	b = binary.LittleEndian.AppendUint64(b, 9000)     // I64 scalar
	return append(b, 0xab)                            // U8
}

func sampleFile(t *testing.T) []byte {
	t.Helper()
	tensors, metadata := sampleTable()
	h, err := EncodeHeader(tensors, metadata)
	if err != nil {
		t.Fatal(err)
	}
	return append(h, sampleData()...)
}

func parseBytes(b []byte) ([]Tensor, map[string]string, int64, error) {
	return ParseHeader(bytes.NewReader(b), int64(len(b)))
}

func TestRoundTrip(t *testing.T) {
	file := sampleFile(t)
	tensors, metadata := sampleTable()
	got, gotMeta, dataStart, err := parseBytes(file)
	if err != nil {
		t.Fatal(err)
	}
	if dataStart%8 != 0 || int(dataStart)+len(sampleData()) != len(file) {
		t.Errorf("data starts at %d in a %d-byte file", dataStart, len(file))
	}
	// ParseHeader sorts by (Begin, End, Name): the empty tensor comes first
	// at its offset.
	want := sortedCopy(tensors)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("tensors:\n got %+v\nwant %+v", got, want)
	}
	if !reflect.DeepEqual(gotMeta, metadata) {
		t.Errorf("metadata: got %q, want %q", gotMeta, metadata)
	}
}

func sortedCopy(tensors []Tensor) []Tensor {
	out := append([]Tensor(nil), tensors...)
	sortByOffset(out)
	return out
}

func TestNoMetadataNoTensors(t *testing.T) {
	for _, md := range []map[string]string{nil, {}} {
		h, err := EncodeHeader(nil, md)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(h[8:]); got != "{}      " {
			t.Errorf("EncodeHeader(nil, %v) JSON = %q", md, got)
		}
		tensors, gotMeta, dataStart, err := parseBytes(h)
		if err != nil || len(tensors) != 0 || gotMeta != nil || dataStart != 16 {
			t.Errorf("ParseHeader = %v, %v, %d, %v", tensors, gotMeta, dataStart, err)
		}
	}
}

// TestGolden pins the exact bytes EncodeHeader writes. The golden file was
// checked to load with the reference safetensors library; if this test
// fails, the on-disk format changed.
func TestGolden(t *testing.T) {
	path := filepath.Join("testdata", "golden.safetensors")
	file := sampleFile(t)
	if *update {
		if err := os.WriteFile(path, file, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, want) {
		t.Errorf("EncodeHeader output changed:\n got %q\nwant %q", file, want)
	}
	const wantJSON = `{"__metadata__":{"format":"pt","note":"quote \" backslash \\ tab \t é"},` +
		`"embed.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},` +
		`"layers.0.bias":{"dtype":"F16","shape":[3],"data_offsets":[16,22]},` +
		`"empty":{"dtype":"F64","shape":[0,5],"data_offsets":[22,22]},` +
		`"mask":{"dtype":"BOOL","shape":[2],"data_offsets":[22,24]},` +
		`"step":{"dtype":"I64","shape":[],"data_offsets":[24,32]},` +
		`"odd \"name\"\\é\n":{"dtype":"U8","shape":[1,1],"data_offsets":[32,33]}}`
	n := binary.LittleEndian.Uint64(file)
	if got := strings.TrimRight(string(file[8:8+n]), " "); got != wantJSON {
		t.Errorf("header JSON:\n got %s\nwant %s", got, wantJSON)
	}
}

// TestReadsReferenceWriter parses a file the reference library wrote
// (testdata/reference.safetensors, made by safetensors 0.8.0's save_file
// from numpy arrays: a F32 [2,3] of 0..5, b I64 [] = 7, c U8 [4] = 1..4,
// with metadata {"who": "safetensors"}; it lays tensors out by descending
// alignment, not by name), so the reader is checked against the real writer
// even where Python is not available.
func TestReadsReferenceWriter(t *testing.T) {
	file, err := os.ReadFile(filepath.Join("testdata", "reference.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	tensors, metadata, dataStart, err := parseBytes(file)
	if err != nil {
		t.Fatal(err)
	}
	want := []Tensor{
		{Name: "b", DType: dtype.I64, Shape: []int64{}, Begin: 0, End: 8},
		{Name: "a", DType: dtype.F32, Shape: []int64{2, 3}, Begin: 8, End: 32},
		{Name: "c", DType: dtype.U8, Shape: []int64{4}, Begin: 32, End: 36},
	}
	if !reflect.DeepEqual(tensors, want) {
		t.Errorf("tensors:\n got %+v\nwant %+v", tensors, want)
	}
	if metadata["who"] != "safetensors" || len(metadata) != 1 {
		t.Errorf("metadata = %q", metadata)
	}
	data := file[dataStart:]
	if v := math.Float32frombits(binary.LittleEndian.Uint32(data[8+20:])); v != 5 {
		t.Errorf("a[1][2] = %v, want 5", v)
	}
	if v := binary.LittleEndian.Uint64(data); v != 7 {
		t.Errorf("b = %d, want 7", v)
	}
	if !bytes.Equal(data[32:36], []byte{1, 2, 3, 4}) {
		t.Errorf("c = %v", data[32:36])
	}
}

func TestEncodeHeaderRejects(t *testing.T) {
	f32 := func(name string, n, begin int64) Tensor {
		return Tensor{Name: name, DType: dtype.F32, Shape: []int64{n}, Begin: begin, End: begin + 4*n}
	}
	cases := []struct {
		name     string
		tensors  []Tensor
		metadata map[string]string
	}{
		{"gap at start", []Tensor{f32("a", 1, 4)}, nil},
		{"gap between", []Tensor{f32("a", 1, 0), f32("b", 1, 8)}, nil},
		{"overlap", []Tensor{f32("a", 2, 0), f32("b", 1, 4)}, nil},
		{"out of order", []Tensor{f32("b", 1, 4), f32("a", 1, 0)}, nil},
		{"duplicate name", []Tensor{f32("a", 1, 0), f32("a", 1, 4)}, nil},
		{"empty name", []Tensor{f32("", 1, 0)}, nil},
		{"reserved name", []Tensor{f32("__metadata__", 1, 0)}, nil},
		{"invalid utf-8 name", []Tensor{f32("a\xff", 1, 0)}, nil},
		{"unknown dtype", []Tensor{{Name: "a", DType: "F128", Shape: []int64{1}, Begin: 0, End: 16}}, nil},
		{"size mismatch", []Tensor{{Name: "a", DType: dtype.F32, Shape: []int64{2}, Begin: 0, End: 4}}, nil},
		{"negative dim", []Tensor{{Name: "a", DType: dtype.F32, Shape: []int64{-1}, Begin: 0, End: 0}}, nil},
		{"end before begin", []Tensor{{Name: "a", DType: dtype.F32, Shape: []int64{0}, Begin: 0, End: -4}}, nil},
		{"overflowing shape", []Tensor{{Name: "a", DType: dtype.F64, Shape: []int64{1 << 40, 1 << 40}, Begin: 0, End: 8}}, nil},
		{"invalid utf-8 metadata", nil, map[string]string{"k": "\xff"}},
	}
	for _, tc := range cases {
		if _, err := EncodeHeader(tc.tensors, tc.metadata); !errors.Is(err, ErrInvalidTable) {
			t.Errorf("%s: error %v, want ErrInvalidTable", tc.name, err)
		}
	}
}

// header builds a file from raw JSON and a data section of dataLen bytes.
func header(json string, dataLen int) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(json)))
	b = append(b, json...)
	return append(b, make([]byte, dataLen)...)
}

func withLength(n uint64, rest string) []byte {
	return append(binary.LittleEndian.AppendUint64(nil, n), rest...)
}

func TestParseHeaderRejects(t *testing.T) {
	const a = `"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}`
	cases := []struct {
		name string
		file []byte
	}{
		{"empty file", nil},
		{"short prefix", []byte{2, 0, 0}},
		{"length past end", withLength(100, "{}")},
		{"length over limit", withLength(MaxHeaderSize+1, "{}")},
		{"length 2^64-1", withLength(math.MaxUint64, "{}")},
		{"zero length", withLength(0, "")},
		{"not json", header("{nope}", 0)},
		{"not an object", header(`["a"]`, 0)},
		{"leading space", header(` {}`, 0)},
		{"trailing garbage", header(`{}x`, 0)},
		{"two objects", header(`{}{}`, 0)},
		{"truncated json", header(`{"a":{"dtype":"F32"`, 0)},
		{"invalid utf-8", header("{\"a\xff\":{}}", 0)},
		{"unknown dtype", header(`{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}`, 16)},
		{"dtype wrong case", header(`{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}`, 8)},
		{"member wrong case", header(`{"a":{"DType":"F32","shape":[2],"data_offsets":[0,8]}}`, 8)},
		{"missing shape", header(`{"a":{"dtype":"F32","data_offsets":[0,8]}}`, 8)},
		{"null shape", header(`{"a":{"dtype":"F32","shape":null,"data_offsets":[0,8]}}`, 8)},
		{"float dim", header(`{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}`, 8)},
		{"negative dim", header(`{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}`, 8)},
		{"three offsets", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}`, 8)},
		{"offsets not numbers", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}`, 8)},
		{"tensor not object", header(`{"a":5}`, 0)},
		{"tensor null", header(`{"a":null}`, 0)},
		{"size mismatch", header(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, 8)},
		{"gap at start", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12)},
		{"gap between", header(`{`+a+`,"b":{"dtype":"U8","shape":[1],"data_offsets":[9,10]}}`, 10)},
		{"overlap", header(`{`+a+`,"b":{"dtype":"U8","shape":[2],"data_offsets":[7,9]}}`, 9)},
		{"data longer", header(`{`+a+`}`, 9)},
		{"data shorter", header(`{`+a+`}`, 7)},
		{"offset overflow", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[9223372036854775807,-9223372036854775808]}}`, 1)},
		{"offset beyond int64", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551615]}}`, 1)},
		{"duplicate tensor", header(`{`+a+`,`+a+`}`, 8)},
		{"duplicate metadata", header(`{"__metadata__":{},"__metadata__":{}}`, 0)},
		{"metadata not strings", header(`{"__metadata__":{"step":9000}}`, 0)},
		{"metadata not object", header(`{"__metadata__":"x"}`, 0)},
		{"empty name", header(`{"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, 0)},
		{"overflowing shape", header(`{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, 0)},
	}
	for _, tc := range cases {
		tensors, _, _, err := parseBytes(tc.file)
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: got %v, %v; want ErrMalformed", tc.name, tensors, err)
		}
	}
}

func TestParseHeaderAccepts(t *testing.T) {
	cases := map[string]string{
		"padded with spaces":  `{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}      `,
		"json whitespace":     "{ \"a\" : {\"dtype\":\"U8\", \"shape\":[ 1 ],\n\"data_offsets\":[0,1]} }\n\t ",
		"unknown member":      `{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"x":[1]}}}`,
		"null metadata":       `{"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`,
		"any order":           `{"b":{"dtype":"U8","shape":[],"data_offsets":[0,1]},"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`,
		"escaped name":        `{"\u00e9\"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`,
		"large header offset": `{"a":{"dtype":"U8","shape":[1,1,1],"data_offsets":[0,1]}}`,
	}
	for name, json := range cases {
		tensors, _, dataStart, err := parseBytes(header(json, 1))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if dataStart != int64(8+len(json)) || tensors[len(tensors)-1].End != 1 {
			t.Errorf("%s: dataStart %d, tensors %+v", name, dataStart, tensors)
		}
	}
}

// errReader fails every read, as a broken disk would.
type errReader struct{}

func (errReader) ReadAt([]byte, int64) (int, error) { return 0, errors.New("disk on fire") }

func TestParseHeaderReadError(t *testing.T) {
	_, _, _, err := ParseHeader(errReader{}, 100)
	if err == nil || errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "disk on fire") {
		t.Errorf("error %v: want the read error, not ErrMalformed", err)
	}
	// A file that shrank under us reads short: also not ErrMalformed.
	file := sampleFile(t)
	_, _, _, err = ParseHeader(bytes.NewReader(file[:20]), int64(len(file)))
	if err == nil || errors.Is(err, ErrMalformed) {
		t.Errorf("short read: %v", err)
	}
}

// FuzzParseHeader checks ParseHeader never panics, never accepts a table
// EncodeHeader would refuse, and that what it accepts re-encodes to an
// equivalent header.
func FuzzParseHeader(f *testing.F) {
	tensors, metadata := sampleTable()
	valid, _ := EncodeHeader(tensors, metadata)
	f.Add(append(valid, sampleData()...))
	f.Add(header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 8))
	f.Add(header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 7))
	f.Add(header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12))
	f.Add(header(`{"__metadata__":{"k":"v"}}`, 0))
	f.Add(header(`{"a":null}`, 0))
	f.Add(withLength(math.MaxUint64, "{}"))
	f.Add(withLength(40, "{}"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, file []byte) {
		tensors, metadata, dataStart, err := parseBytes(file)
		if err != nil {
			return
		}
		if dataStart < 8 || dataStart > int64(len(file)) {
			t.Fatalf("data start %d outside a %d-byte file", dataStart, len(file))
		}
		// EncodeHeader takes tensors in offset order, as ParseHeader returns them.
		h, err := EncodeHeader(tensors, metadata)
		if err != nil {
			t.Fatalf("accepted a table EncodeHeader refuses: %v", err)
		}
		again, againMeta, _, err := parseBytes(append(h, file[dataStart:]...))
		if err != nil {
			t.Fatalf("re-encoded header does not parse: %v", err)
		}
		if !reflect.DeepEqual(again, tensors) || len(againMeta) != len(metadata) {
			t.Fatalf("re-encoding changed the table:\n%+v\n%+v", tensors, again)
		}
	})
}

// TestHugeLengthAllocatesNothing checks the header length is checked
// against the limits before a buffer of that size is made.
func TestHugeLengthAllocatesNothing(t *testing.T) {
	for _, n := range []uint64{MaxHeaderSize, MaxHeaderSize + 1, 1 << 40} {
		file := withLength(n, "{}")
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, _, _, err := parseBytes(file)
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("length %d: error %v", n, err)
		}
		if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<10 {
			t.Errorf("length %d: allocated %d bytes before rejecting", n, grew)
		}
	}
}
