package checkpoint

import (
	"context"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// BenchmarkReadShard restores a 256 MiB bf16 shard from a page-cached
// POSIX store into memory: the daemon's side of a restore from storage.
// Run it with -cpu 1 to read its cost in CPU per byte.
func BenchmarkReadShard(b *testing.B) {
	for _, c := range []codec.Codec{codec.None, codec.FloatBF16, codec.Zstd, codec.LZ4} {
		b.Run(string(c), func(b *testing.B) {
			back, _ := newBackendTB(b)
			w, err := NewWriter(back, WriterOptions{ChunkSize: 4 << 20, Codec: c})
			if err != nil {
				b.Fatal(err)
			}
			const n = 128 << 20 // elements
			data := bf16s(n, 1)
			l, err := NewLayout([]Tensor{{Name: "w", DType: dtype.BF16, Shape: []int64{n}, Length: 2 * n}})
			if err != nil {
				b.Fatal(err)
			}
			sh := &Shard{Target: Target{Job: "job", Step: 1, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
			m, err := w.WriteShard(context.Background(), sh)
			if err != nil {
				b.Fatal(err)
			}
			store, _ := NewStore(back, "job")
			dst := make(BufferSink, m.DataSize)
			clear(dst)
			b.SetBytes(m.DataSize)
			for b.Loop() {
				if err := store.ReadShard(context.Background(), m, dst, ReadOptions{}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
