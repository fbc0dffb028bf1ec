package checkpoint

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

func validManifest(t testing.TB) []byte {
	t.Helper()
	b, _ := newBackendTB(t)
	w, _ := NewWriter(b, WriterOptions{ChunkSize: 64 << 10})
	m, err := w.WriteShard(context.Background(), testShard(1, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	data, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestManifestRoundTrip(t *testing.T) {
	data := validManifest(t)
	m, err := ParseManifest(data)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := m.Encode()
	if string(again) != string(data) {
		t.Fatal("encode(parse(x)) != x")
	}
}

func TestManifestRejects(t *testing.T) {
	good := string(validManifest(t))
	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"future version", `"version": 2`, `"version": 5`, "version 5 is not supported"},
		{"key before version 4", `"hash": "xxh3:`, `"key": "xxh3-128:00000000000000000000000000000000", "hash": "xxh3:`, "content key in a version 2"},
		{"version 1 with an attempt", `"version": 2`, `"version": 1`, "version 1 has no attempt"},
		{"no attempt", `"attempt": "run-1",`, ``, "names no attempt"},
		{"bad attempt", `"attempt": "run-1"`, `"attempt": "../x"`, "attempt"},
		{"huge offset", `"offset": 0,
   "stored"`, `"offset": 9223372036854775807,
   "stored"`, "out of range"},
		{"other format", `"ckptd.manifest"`, `"other"`, "format"},
		{"escaping object", `"object": "steps/000000000001/run-1/rank-00000.data"`, `"object": "steps/../../etc/passwd"`, "invalid object name"},
		{"bad codec", `"codec": "zstd"`, `"codec": "brotli"`, "brotli"},
		{"bad hash", `"hash": "xxh3:`, `"hash": "md5:`, "hash"},
		{"data size", `"data_size": `, `"data_size": 1`, "data_size"},
		{"unknown field", `"job":`, `"jobb": 1, "job":`, "unknown field"},
		{"not json", `{`, `[`, "JSON"},
		{"bad job", `"job": "job"`, `"job": "a/b"`, "contains"},
	} {
		bad := strings.Replace(good, tc.old, tc.new, 1)
		if bad == good {
			t.Fatalf("%s: replacement %q not found", tc.name, tc.old)
		}
		_, err := ParseManifest([]byte(bad))
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrCorrupt containing %q", tc.name, err, tc.want)
		}
	}
}

func FuzzParseManifest(f *testing.F) {
	f.Add(validManifest(f))
	f.Add([]byte(`{"format":"ckptd.manifest","version":1}`))
	f.Add([]byte(`{"format":"ckptd.manifest","version":2,"attempt":"a","job":"j","world_size":1,"tensors":[{"name":"a","dtype":"U8","shape":[4611686018427387904],"offset":0,"length":4611686018427387904}],"chunks":[{"object":"steps/x","offset":9223372036854775000,"raw":4,"stored":4000,"codec":"none","hash":"xxh3:0000000000000000"}],"data_size":4,"stored_size":4}`))
	f.Add([]byte(`{"format":"ckptd.manifest","version":1,"job":"j","world_size":1,"tensors":[{"name":"a","dtype":"F32","shape":[1],"offset":0,"length":4}],"chunks":[{"object":"steps/x","raw":4,"stored":4,"codec":"none","hash":"xxh3:0000000000000000"}],"data_size":4,"stored_size":4}`))
	f.Add([]byte(`{"format":"ckptd.manifest","version":4,"attempt":"a","job":"j","world_size":1,"tensors":[{"name":"a","dtype":"F32","shape":[1],"offset":0,"length":4}],"chunks":[{"object":"steps/000000000001/a/rank-00000.data","raw":4,"stored":4,"codec":"none","hash":"xxh3:0000000000000000","key":"xxh3-128:0123456789abcdef0123456789abcdef"}],"data_size":4,"stored_size":4}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := ParseManifest(data)
		if err != nil {
			return
		}
		// Whatever parses must be internally consistent: chunks tile the
		// data, and re-encoding parses again.
		var raw int64
		for _, c := range m.Chunks {
			raw += c.Raw
		}
		if raw != m.DataSize {
			t.Fatalf("accepted manifest whose chunks cover %d of %d bytes", raw, m.DataSize)
		}
		again, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParseManifest(again); err != nil {
			t.Fatalf("re-encoded manifest rejected: %v", err)
		}
	})
}

// everyDType is a shard with one tensor of each dtype ckptd stores (with
// bytes that compress, and that do not), for the manifest and codec tests.
func everyDType(t *testing.T) *Shard {
	t.Helper()
	var ts []Tensor
	var data []byte
	for i, dt := range dtype.All() {
		shape := []int64{int64(3000 + i), 2}
		n, err := dt.NumBytes(shape)
		if err != nil {
			t.Fatal(err)
		}
		b := floats(int(n/4)+1, uint64(i))[:n] // noisy bytes
		for j := range b[:n/2] {
			b[j] = byte(j % 7) // and a run that compresses
		}
		off := (int64(len(data)) + 15) / 16 * 16 // a gap, as a client aligning tensors leaves
		data = append(data, make([]byte, off-int64(len(data)))...)
		ts = append(ts, Tensor{Name: "t." + string(dt), DType: dt, Shape: shape, Offset: off, Length: n})
		data = append(data, b...)
	}
	ts = append(ts, Tensor{Name: "scalar", DType: dtype.Complex128, Shape: []int64{}, Offset: int64(len(data)), Length: 16})
	data = append(data, floats(4, 99)...)
	l, err := NewLayout(ts)
	if err != nil {
		t.Fatal(err)
	}
	return &Shard{Target: Target{Job: "job", Step: 1, Rank: 0, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
}

func TestEveryDTypeIsStoredBitExact(t *testing.T) {
	for _, c := range []codec.Codec{codec.Auto, codec.Zstd, codec.LZ4, codec.None, codec.FloatBF16, codec.FloatF64} {
		t.Run(string(c), func(t *testing.T) {
			b, _ := newBackendTB(t)
			w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Codec: c})
			if err != nil {
				t.Fatal(err)
			}
			sh := everyDType(t)
			m, err := w.WriteShard(context.Background(), sh)
			if err != nil {
				t.Fatal(err)
			}
			enc, err := m.Encode()
			if err != nil {
				t.Fatal(err)
			}
			parsed, err := ParseManifest(enc)
			if err != nil {
				t.Fatal(err)
			}
			store := &Store{backend: b, job: "job"}
			for i, pt := range parsed.Tensors {
				rt := sh.Layout.Region[i]
				if pt.Name != rt.Name || pt.DType != rt.DType || !slices.Equal(pt.Shape, rt.Shape) {
					t.Fatalf("manifest tensor %d is %+v, staged %+v", i, pt, rt)
				}
				got, err := store.ReadTensor(context.Background(), parsed, pt, ReadOptions{})
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, sh.Data[rt.Offset:rt.Offset+rt.Length]) {
					t.Fatalf("%s: bytes differ after the round trip", pt.Name)
				}
			}
		})
	}
}

func TestManifestDTypes(t *testing.T) {
	good := string(validManifest(t))
	// Every dtype's name is accepted where its length fits; the F32 table
	// entry is [512, 700], 1433600 bytes.
	for _, dt := range dtype.All() {
		n, _ := dt.NumBytes([]int64{512, 700})
		m := strings.Replace(good, `"dtype": "F32",
   "shape": [
    512,
    700
   ],
   "offset": 0,
   "length": 1433600`, fmt.Sprintf(`"dtype": %q,
   "shape": [
    %d
   ],
   "offset": 0,
   "length": 1433600`, dt, 1433600/dt.Size()), 1)
		if m == good {
			t.Fatal("F32 table entry not found")
		}
		if _, err := ParseManifest([]byte(m)); err != nil {
			t.Errorf("%s (%d bytes for [512, 700]): %v", dt, n, err)
		}
	}
	for _, tc := range []struct{ dtype, want string }{
		{"X9", `unknown dtype "X9"`},
		{"f32", `unknown dtype "f32"`},
		{"F4", `unknown dtype "F4"`}, // safetensors' name for the values; ckptd stores FLOAT4_E2M1FN_X2
	} {
		bad := strings.Replace(good, `"dtype": "F32"`, fmt.Sprintf(`"dtype": %q`, tc.dtype), 1)
		_, err := ParseManifest([]byte(bad))
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "C128") {
			t.Errorf("%s: %v, want ErrCorrupt naming it and the dtypes accepted", tc.dtype, err)
		}
	}
	// A length that does not fit the dtype's size.
	bad := strings.Replace(good, `"dtype": "F32"`, `"dtype": "C128"`, 1)
	if _, err := ParseManifest([]byte(bad)); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "C128[512 700] needs 5734400 bytes") {
		t.Errorf("C128 with F32's length: %v", err)
	}
}
