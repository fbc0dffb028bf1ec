package prefetch

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"testing"

	"github.com/parquet-go/parquet-go"
)

// BenchmarkFormats reads one epoch of the same samples (8 shards of 256
// samples of an 8-byte id and 4 KiB of text) as WebDataset tar, MDS
// (uncompressed and zstd) and Parquet (snappy), from a warm memory cache:
// what parsing each format costs the daemon. Compare the sub-benchmarks'
// MB/s with tar's (the baseline) of the same run.
func BenchmarkFormats(b *testing.B) {
	const shards, per, payload = 8, 256, 4 << 10
	dir := b.TempDir()
	text := func(k int) []byte { return bytes.Repeat([]byte(fmt.Sprintf("<%d>", k)), payload)[:payload] }
	for s := range shards {
		var ms []tarMember
		for i := range per {
			k := s*per + i
			key := fmt.Sprintf("s%03d/%06d", s, i)
			ms = append(ms, tarMember{key + ".n", binary.LittleEndian.AppendUint64(nil, uint64(k))}, tarMember{key + ".text", text(k)})
		}
		writeFile(b, filepath.Join(dir, "tar", fmt.Sprintf("shard-%03d.tar", s)), tarOf(b, ms...))
	}
	writeMDS(b, filepath.Join(dir, "mds"), shards, per, payload, false)
	writeMDS(b, filepath.Join(dir, "mdszstd"), shards, per, payload, true)
	type row struct {
		N    int64  `parquet:"n"`
		Text []byte `parquet:"text"`
	}
	var buf bytes.Buffer
	w := parquet.NewGenericWriter[row](&buf, parquet.Compression(&parquet.Snappy))
	for k := range shards * per {
		if _, err := w.Write([]row{{N: int64(k), Text: text(k)}}); err != nil {
			b.Fatal(err)
		}
		if (k+1)%per == 0 {
			if err := w.Flush(); err != nil { // a row group a shard
				b.Fatal(err)
			}
		}
	}
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	writeFile(b, filepath.Join(dir, "parquet", "data.parquet"), buf.Bytes())

	backend := testdataBackend(b, dir)
	for _, f := range []struct {
		name   string
		format Format
	}{{"tar", WebDataset}, {"mds", MDS}, {"mdszstd", MDS}, {"parquet", Parquet}} {
		b.Run(f.name, func(b *testing.B) {
			c, err := NewCache(1 << 30)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			epoch := func() int {
				it, err := Open(context.Background(), backend, f.name+"/", c, Spec{Format: f.format, BatchSize: 64, WorldSize: 1, ShuffleWindow: 1}, Options{})
				if err != nil {
					b.Fatal(err)
				}
				defer it.Close()
				n := 0
				for {
					batch, err := it.Next(context.Background())
					if errors.Is(err, io.EOF) {
						return n
					}
					if err != nil {
						b.Fatal(err)
					}
					n += len(batch.Samples)
				}
			}
			if n := epoch(); n != shards*per { // warms the cache
				b.Fatalf("%d samples, want %d", n, shards*per)
			}
			b.SetBytes(int64(shards * per * (payload + 8)))
			b.ResetTimer()
			for b.Loop() {
				epoch()
			}
		})
	}
}
