package posix_test

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/ckptd/ckptd/storage/posix"
)

// BenchmarkPut measures whole-object Puts (write, fsync, rename, directory
// fsync) of a large shard and of many small objects, where the per-object
// path work (resolving folders, creating the temporary file) shows most.
func BenchmarkPut(b *testing.B) {
	for _, tt := range []struct {
		name string
		size int
	}{
		{"1GiB", 1 << 30},
		{"4KiB", 4 << 10},
	} {
		b.Run(tt.name, func(b *testing.B) {
			store, err := posix.New(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			defer store.Close()
			data := patterned(tt.size)
			b.SetBytes(int64(tt.size))
			b.ResetTimer()
			for i := range b.N {
				name := fmt.Sprintf("job/steps/%012d/rank-%05d.data", i%8, i)
				if err := store.Put(b.Context(), name, bytes.NewReader(data), int64(len(data))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkGetStat measures the per-call cost of Stat and of opening a small
// ranged Get, which restores and listings pay per object.
func BenchmarkGetStat(b *testing.B) {
	store, err := posix.New(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
	const name = "job/steps/000000000001/rank-00000.manifest.json"
	if err := store.Put(b.Context(), name, bytes.NewReader(patterned(4096)), 4096); err != nil {
		b.Fatal(err)
	}
	b.Run("Stat", func(b *testing.B) {
		for range b.N {
			if _, err := store.Stat(b.Context(), name); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("Get", func(b *testing.B) {
		buf := make([]byte, 512)
		for range b.N {
			rc, err := store.Get(b.Context(), name, 100, 512)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := rc.Read(buf); err != nil {
				b.Fatal(err)
			}
			rc.Close()
		}
	})
}
