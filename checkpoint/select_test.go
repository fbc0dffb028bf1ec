package checkpoint

import (
	"bytes"
	"context"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// ReadSelected brings back exactly the selected tensors, packed in the
// order asked, whatever the codec and however the tensors and chunks
// overlap: chunks within one tensor are read into place, chunks shared by
// several are scattered, and ranges that share a chunk read it once.
func TestReadSelected(t *testing.T) {
	var ts []Tensor
	var data []byte
	add := func(name string, b []byte) {
		ts = append(ts, Tensor{Name: name, DType: dtype.U8, Shape: []int64{int64(len(b))}, Offset: int64(len(data)), Length: int64(len(b))})
		data = append(data, b...)
	}
	add("big", floats(100<<10, 1))   // 400 KiB: chunks within it
	add("tiny", []byte{1, 2, 3})     // shares a chunk with its neighbours
	add("mid", floats(20<<10, 2))    // 80 KiB: across two chunks
	add("tiny2", []byte{4, 5, 6, 7}) // shares a chunk with mid and last
	add("last", floats(70<<10, 3))
	l, err := NewLayout(ts)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []codec.Codec{codec.None, codec.Zstd} {
		t.Run(string(c), func(t *testing.T) {
			b, _ := newBackend(t)
			w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Codec: c, Workers: 2})
			if err != nil {
				t.Fatal(err)
			}
			sh := &Shard{Target: Target{Job: "job", Step: 1, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
			if _, err := w.WriteShard(context.Background(), sh); err != nil {
				t.Fatal(err)
			}
			store, _ := NewStore(b, "job")
			rec, _, err := store.TryCommit(context.Background(), 1, testAttempt, 1)
			if err != nil || rec == nil {
				t.Fatalf("commit: %v, %v", rec, err)
			}
			m, err := store.Manifest(context.Background(), rec, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, names := range [][]string{
				{"big"}, {"tiny"}, {"mid", "tiny"}, {"last", "tiny2", "big"}, {"tiny", "tiny2"},
				{"tiny2", "mid", "last", "tiny", "big"},
			} {
				sel, err := SelectTensors(m, names)
				if err != nil {
					t.Fatal(err)
				}
				dst := bytes.Repeat([]byte{0xee}, int(sel.Size))
				if err := store.ReadSelected(context.Background(), m, sel, dst, ReadOptions{Concurrency: 3, SpanBytes: 100 << 10}); err != nil {
					t.Fatal(err)
				}
				var want []byte
				for _, name := range names {
					for _, tn := range ts {
						if tn.Name == name {
							want = append(want, data[tn.Offset:tn.Offset+tn.Length]...)
						}
					}
				}
				if !bytes.Equal(dst, want) {
					t.Fatalf("%v: wrong bytes", names)
				}
				for i, tn := range sel.Table {
					if tn.Name != names[i] {
						t.Fatalf("%v: table %v", names, sel.Table)
					}
				}
			}
		})
	}
}
