package checkpoint

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// naive counts non-finite values one element at a time, the obvious way.
func naive(dt dtype.DType, b []byte) int64 {
	var n int64
	bad32 := func(f float32) bool { return math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) }
	switch dt {
	case dtype.F32:
		for i := 0; i+4 <= len(b); i += 4 {
			if bad32(math.Float32frombits(binary.LittleEndian.Uint32(b[i:]))) {
				n++
			}
		}
	case dtype.BF16:
		for i := 0; i+2 <= len(b); i += 2 {
			if bad32(math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[i:])) << 16)) {
				n++
			}
		}
	case dtype.F16:
		for i := 0; i+2 <= len(b); i += 2 {
			if binary.LittleEndian.Uint16(b[i:])>>10&0x1F == 0x1F {
				n++
			}
		}
	case dtype.F64:
		for i := 0; i+8 <= len(b); i += 8 {
			f := math.Float64frombits(binary.LittleEndian.Uint64(b[i:]))
			if math.IsNaN(f) || math.IsInf(f, 0) {
				n++
			}
		}
	}
	return n
}

func TestCountNonFinite(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, dt := range []dtype.DType{dtype.F32, dtype.BF16, dtype.F16, dtype.F64} {
		for _, n := range []int{0, 1, 2, 7, 8, 9, 15, 64, 1001} {
			b := make([]byte, n)
			for i := range b {
				b[i] = byte(r.Uint32())
				if r.IntN(4) == 0 { // exponent bits all ones, often
					b[i] = 0xFF
				}
			}
			if got, want := countNonFinite(dt, b), naive(dt, b); got != want {
				t.Errorf("%s over %d bytes: %d, want %d", dt, n, got, want)
			}
		}
	}
	f32 := func(vs ...float32) []byte {
		var b []byte
		for _, v := range vs {
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
		}
		return b
	}
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	for _, tc := range []struct {
		dt   dtype.DType
		b    []byte
		want int64
	}{
		{dtype.F32, f32(1, -inf, nan, 3.4e38, -0, inf), 3},
		{dtype.Complex, f32(1, nan, inf, 2), 2}, // each part counts
		{dtype.I32, f32(nan, nan), 0},           // integers hold no NaN
		{dtype.F8E4M3, []byte{0x7F, 0xFF, 0x7E, 0x78}, 2},
		{dtype.F8E5M2, []byte{0x7C, 0xFC, 0x7B, 0x7F}, 3},
		{dtype.F8E4M3FNUZ, []byte{0x80, 0x00, 0x7F}, 1},
		{dtype.F8E8M0, []byte{0xFF, 0xFE}, 1},
		{dtype.F4X2, []byte{0xFF}, 0},
	} {
		if got := countNonFinite(tc.dt, tc.b); got != tc.want {
			t.Errorf("%s %x: %d, want %d", tc.dt, tc.b, got, tc.want)
		}
	}
}

func BenchmarkCountNonFinite(b *testing.B) {
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	for _, dt := range []dtype.DType{dtype.BF16, dtype.F32} {
		b.Run(string(dt), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				countNonFinite(dt, data)
			}
		})
	}
}

// A drained shard's manifest counts each tensor's non-finite values, as
// version 3; the commit record sums them over the ranks. A shard with
// none stays a version 2 manifest, which older readers take.
func TestWriteShardCountsNonFinite(t *testing.T) {
	ctx := t.Context()
	b, _ := newBackend(t)
	w, err := NewWriter(b, WriterOptions{ChunkSize: 4096})
	if err != nil {
		t.Fatal(err)
	}
	store, _ := NewStore(b, "job")
	clean := testShard(1, 0, 2)
	m, err := w.WriteShard(ctx, clean)
	if values, tensors := m.NonFinite(); err != nil || m.Version != ManifestVersion || values != 0 || tensors != 0 {
		t.Fatalf("a finite shard: version %d, %d non-finite in %d tensors, %v", m.Version, values, tensors, err)
	}
	diverged := testShard(1, 1, 2)
	nan := math.Float32bits(float32(math.NaN()))
	// Into the big fp32 matrix, across a chunk boundary (4096 bytes), and
	// into the bf16 bias; the 0-d scalar becomes +Inf.
	for _, off := range []int64{0, 4092, 4096, 9000} {
		binary.LittleEndian.PutUint32(diverged.Data[off:], nan)
	}
	byName := map[string]Tensor{}
	for _, tn := range diverged.Layout.Region {
		byName[tn.Name] = tn
	}
	binary.LittleEndian.PutUint32(diverged.Data[byName["scalar"].Offset:], math.Float32bits(float32(math.Inf(1))))
	binary.LittleEndian.PutUint16(diverged.Data[byName["layer.0.bias"].Offset+10:], 0xFFC0) // a bf16 NaN
	m, err = w.WriteShard(ctx, diverged)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, tn := range m.Tensors {
		got[tn.Name] = tn.NonFinite
	}
	if m.Version != ManifestVersionNonFinite || got["layer.0.weight"] != 4 || got["scalar"] != 1 || got["layer.0.bias"] != 1 || got["step_count"] != 0 {
		t.Fatalf("version %d, counts %v; want version 3, 4 in the weight, 1 in the scalar and 1 in the bias", m.Version, got)
	}
	if diverged.Layout.Packed[0].NonFinite != 0 {
		t.Error("the counts were written into the staged layout, not a copy")
	}
	rec, won, err := store.TryCommit(ctx, 1, testAttempt, 2)
	if err != nil || !won || rec.NonFinite != 6 || rec.NonFiniteTensors != 3 {
		t.Fatalf("commit record %+v, %v; want 6 non-finite values in 3 tensors", rec, err)
	}
	again, err := store.ReadCommit(ctx, 1)
	if err != nil || again.NonFinite != 6 {
		t.Fatalf("the commit record read back: %+v, %v", again, err)
	}
	stored, err := store.Manifest(ctx, rec, 1)
	if err != nil || stored.Tensors[0].NonFinite != 4 {
		t.Fatalf("the version 3 manifest read back: %v", err)
	}
	if mm := MemoryManifest(diverged.Target, diverged.Layout, nil, packed(diverged), 4096); mm.Version != ManifestVersionNonFinite {
		t.Errorf("a memory manifest of the same shard: version %d, want 3", mm.Version)
	}
}

// packed returns sh's data in data space.
func packed(sh *Shard) []byte {
	data := make([]byte, sh.Layout.DataSize)
	sh.Layout.Pack(sh.Data, data)
	return data
}
