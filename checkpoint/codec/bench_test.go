package codec

import (
	"fmt"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
)

// Benchmarks run on 4 MiB of float-like data, the chunk size the drain
// uses, and report the stored/raw ratio next to the throughput.

var benchInputs = []input{
	{"f32", normalF32(chunkLen, 21)},
	{"bf16", normalBF16(chunkLen, 22)},
}

func BenchmarkEncode(b *testing.B) {
	for _, c := range allCodecs {
		for _, in := range benchInputs {
			b.Run(fmt.Sprintf("%s/%s", c, in.name), func(b *testing.B) {
				dst := make([]byte, 0, MaxEncodedLen(c, len(in.data)))
				b.SetBytes(int64(len(in.data)))
				var out []byte
				for b.Loop() {
					var err error
					if out, err = Encode(c, dst, in.data); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(len(out))/float64(len(in.data)), "ratio")
			})
		}
	}
}

func BenchmarkDecode(b *testing.B) {
	for _, c := range allCodecs {
		for _, in := range benchInputs {
			b.Run(fmt.Sprintf("%s/%s", c, in.name), func(b *testing.B) {
				enc, err := Encode(c, nil, in.data)
				if err != nil {
					b.Fatal(err)
				}
				dst := make([]byte, 0, len(in.data))
				b.SetBytes(int64(len(in.data)))
				for b.Loop() {
					if _, err := Decode(c, dst, enc, len(in.data)); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkEncodeParallel shows that concurrent callers do not serialize
// on a shared encoder.
func BenchmarkEncodeParallel(b *testing.B) {
	in := benchInputs[1]
	for _, c := range []Codec{Zstd, LZ4} {
		b.Run(string(c), func(b *testing.B) {
			b.SetBytes(int64(len(in.data)))
			b.RunParallel(func(pb *testing.PB) {
				dst := make([]byte, 0, MaxEncodedLen(c, len(in.data)))
				for pb.Next() {
					if _, err := Encode(c, dst, in.data); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkZstdSettings is the measurement behind zstdEncoderOptions:
// levels, the all-literal entropy switch and the frame checksum.
func BenchmarkZstdSettings(b *testing.B) {
	settings := []struct {
		name string
		opts []zstd.EOption
	}{
		{"fastest", nil},
		{"fastest+crc", []zstd.EOption{zstd.WithEncoderCRC(true)}},
		{"fastest-alllit", []zstd.EOption{zstd.WithAllLitEntropyCompression(false)}},
		{"default", []zstd.EOption{zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithAllLitEntropyCompression(true)}},
		{"default+crc", []zstd.EOption{zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithAllLitEntropyCompression(true), zstd.WithEncoderCRC(true)}},
		{"better", []zstd.EOption{zstd.WithEncoderLevel(zstd.SpeedBetterCompression)}},
	}
	for _, s := range settings {
		// Later options override the package's, so each row differs from
		// what Encode uses only in what it names.
		enc, err := zstd.NewWriter(nil, append(append([]zstd.EOption{}, zstdEncoderOptions...), s.opts...)...)
		if err != nil {
			b.Fatal(err)
		}
		for _, in := range benchInputs {
			b.Run(s.name+"/"+in.name, func(b *testing.B) {
				dst := make([]byte, 0, zstdBound(len(in.data)))
				b.SetBytes(int64(len(in.data)))
				var out []byte
				for b.Loop() {
					out = enc.EncodeAll(in.data, dst)
				}
				b.ReportMetric(float64(len(out))/float64(len(in.data)), "ratio")
			})
		}
	}
}

// BenchmarkLZ4Compressors compares the library's two fast block
// compressors, which write the same format.
func BenchmarkLZ4Compressors(b *testing.B) {
	var fast lz4.Compressor
	var ccompat lz4.CompressorCCompat
	kinds := []struct {
		name string
		f    func(src, dst []byte) (int, error)
	}{{"fast", fast.CompressBlock}, {"ccompat", ccompat.CompressBlock}}
	for _, k := range kinds {
		for _, in := range benchInputs {
			b.Run(k.name+"/"+in.name, func(b *testing.B) {
				dst := make([]byte, lz4Bound(len(in.data)))
				b.SetBytes(int64(len(in.data)))
				var n int
				for b.Loop() {
					var err error
					if n, err = k.f(in.data, dst); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n)/float64(len(in.data)), "ratio")
			})
		}
	}
}

func BenchmarkHash(b *testing.B) {
	data := benchInputs[0].data
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		Hash(data)
	}
}

// BenchmarkCopyHash against a Hash then a copy of a chunk larger than the
// cache (what a hot-tier restore does per chunk), and a copy alone.
func BenchmarkCopyHash(b *testing.B) {
	src, dst := make([]byte, 4<<20), make([]byte, 4<<20)
	for i := range src {
		src[i] = byte(i)
	}
	b.Run("fused", func(b *testing.B) {
		b.SetBytes(int64(len(src)))
		for b.Loop() {
			CopyHash(dst, src)
		}
	})
	b.Run("hash-then-copy", func(b *testing.B) {
		b.SetBytes(int64(len(src)))
		for b.Loop() {
			Hash(src)
			copy(dst, src)
		}
	})
	b.Run("copy", func(b *testing.B) {
		b.SetBytes(int64(len(src)))
		for b.Loop() {
			copy(dst, src)
		}
	})
}
