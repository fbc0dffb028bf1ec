package checkpoint

import (
	"context"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// BenchmarkReadShard restores a 256 MiB shard from a page-cached POSIX
// store into memory, one chunk at a time: the daemon's side of a restore
// from storage. With -cpu 1 its time is one core's cost per byte. The
// shard is bf16 weights (raw, the float codec, zstd, lz4) or f32 weights
// (raw, the float codec): what auto may choose, and the general codecs.
func BenchmarkReadShard(b *testing.B) {
	for _, tc := range []struct {
		dt dtype.DType
		c  codec.Codec
	}{
		{dtype.BF16, codec.None}, {dtype.BF16, codec.FloatBF16}, {dtype.BF16, codec.Zstd}, {dtype.BF16, codec.LZ4},
		{dtype.F32, codec.None}, {dtype.F32, codec.FloatF32},
	} {
		b.Run(string(tc.dt)+"/"+string(tc.c), func(b *testing.B) {
			store, m := storedShard(b, tc.dt, tc.c, 256<<20)
			dst := make(BufferSink, m.DataSize)
			// The writer bypasses the page cache (O_DIRECT); one read
			// puts the object there, as the benchmark says.
			opts := ReadOptions{Concurrency: 1}
			if err := store.ReadShard(context.Background(), m, dst, opts); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(m.DataSize)
			for b.Loop() {
				if err := store.ReadShard(context.Background(), m, dst, opts); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// storedShard writes one tensor of size bytes of dt weights with c and
// returns the store holding it and its manifest.
func storedShard(b *testing.B, dt dtype.DType, c codec.Codec, size int) (*Store, *Manifest) {
	back, _ := newBackendTB(b)
	w, err := NewWriter(back, WriterOptions{ChunkSize: 4 << 20, Codec: c})
	if err != nil {
		b.Fatal(err)
	}
	data := floats(size/4, 1)
	if dt == dtype.BF16 {
		data = bf16s(size/2, 1)
	}
	n := int64(size / dt.Size())
	l, err := NewLayout([]Tensor{{Name: "w", DType: dt, Shape: []int64{n}, Length: int64(size)}})
	if err != nil {
		b.Fatal(err)
	}
	sh := &Shard{Target: Target{Job: "job", Step: 1, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
	m, err := w.WriteShard(context.Background(), sh)
	if err != nil {
		b.Fatal(err)
	}
	store, err := NewStore(back, "job")
	if err != nil {
		b.Fatal(err)
	}
	return store, m
}
