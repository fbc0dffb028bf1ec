package checkpoint

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage/counted"
)

// selectTestShard saves a shard of tensors that share chunks and span
// several, with codec c, and returns its store and manifest.
func selectTestShard(t *testing.T, c codec.Codec) (*Store, *Manifest, *counted.Backend) {
	t.Helper()
	raw, _ := newBackend(t)
	b := counted.New(raw, nil)
	w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Codec: c, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	sh := &Shard{Target: Target{Job: "job", Step: 1, WorldSize: 1, Attempt: testAttempt}, Layout: selectLayout, Data: selectData}
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
	return store, m, b
}

var selectLayout, selectData = func() (*Layout, []byte) {
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
	add("none", nil)                 // starts where last does
	add("last", floats(70<<10, 3))
	l, err := NewLayout(ts)
	if err != nil {
		panic(err)
	}
	return l, data
}()

// tensorBytes returns the saved bytes of the tensor name.
func tensorBytes(name string) []byte {
	for _, tn := range selectLayout.Packed {
		if tn.Name == name {
			return selectData[tn.Offset : tn.Offset+tn.Length]
		}
	}
	panic(name)
}

// ReadSelected brings back exactly the selected tensors, packed in the
// order asked, whatever the codec and however the tensors and chunks
// overlap: chunks within one tensor are read into place, chunks shared by
// several are scattered, and ranges that share a chunk read it once.
func TestReadSelected(t *testing.T) {
	for _, c := range []codec.Codec{codec.None, codec.Zstd} {
		t.Run(string(c), func(t *testing.T) {
			store, m, _ := selectTestShard(t, c)
			for _, names := range [][]string{
				{"big"}, {"tiny"}, {"mid", "tiny"}, {"last", "tiny2", "big"}, {"tiny", "tiny2"},
				{"tiny2", "mid", "none", "last", "tiny", "big"}, {"none"},
			} {
				sel, err := SelectTensors(m, names)
				if err != nil {
					t.Fatal(err)
				}
				var want []byte
				for _, name := range names {
					want = append(want, tensorBytes(name)...)
				}
				if got := readSelected(t, store, m, sel); !bytes.Equal(got, want) {
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

func readSelected(t *testing.T, store *Store, m *Manifest, sel Selection) []byte {
	t.Helper()
	dst := bytes.Repeat([]byte{0xee}, int(sel.Size))
	if err := store.ReadSelected(context.Background(), m, sel, dst, ReadOptions{Concurrency: 3, SpanBytes: 100 << 10}); err != nil {
		t.Fatal(err)
	}
	return dst
}

// SelectSlices restores byte ranges of tensors, in the order asked, each
// in the table under its tensor's name; slices that overlap, or reach
// past their tensor, are refused.
func TestSelectSlices(t *testing.T) {
	store, m, _ := selectTestShard(t, codec.Zstd)
	slices := []Slice{
		{"mid", 1000, 70000}, {"big", 0, 5}, {"big", 300 << 10, 100 << 10}, {"tiny2", 1, 2},
		{"mid", 0, 1000}, {"last", 10, 0}, {"none", 0, 0},
	}
	sel, err := SelectSlices(m, slices)
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	for i, sl := range slices {
		if tn := sel.Table[i]; tn.Name != sl.Name || tn.Offset != int64(len(want)) || tn.Length != sl.Length {
			t.Fatalf("slice %d: table entry %+v", i, tn)
		}
		want = append(want, tensorBytes(sl.Name)[sl.Offset:sl.Offset+sl.Length]...)
	}
	if sel.Size != int64(len(want)) {
		t.Fatalf("size %d, want %d", sel.Size, len(want))
	}
	if got := readSelected(t, store, m, sel); !bytes.Equal(got, want) {
		t.Fatal("wrong bytes")
	}
	for _, bad := range [][]Slice{
		{{"mid", 0, 100}, {"mid", 99, 2}},
		{{"mid", 1, 80 << 10}},
		{{"mid", -1, 2}},
		{{"nope", 0, 1}},
	} {
		if _, err := SelectSlices(m, bad); !errors.Is(err, ErrInvalid) {
			t.Fatalf("%v: %v", bad, err)
		}
	}
}

// A selection reads the chunks holding what it selects, not those in
// between: two slices far apart in a tensor read two chunks.
func TestSelectionReadsOnlyItsChunks(t *testing.T) {
	store, m, b := selectTestShard(t, codec.None)
	sel, err := SelectSlices(m, []Slice{{"big", 10, 5}, {"big", 300 << 10, 10}})
	if err != nil {
		t.Fatal(err)
	}
	before := b.ReadBytes()
	readSelected(t, store, m, sel)
	if got := b.ReadBytes() - before; got != 2*64<<10 {
		t.Fatalf("read %d bytes for two slices within two 64 KiB chunks", got)
	}
}

// A selection in place is the span of the data space holding what it
// selects, each entry of its table pointing at its own bytes there, and
// checking it verifies the chunks it touches: a spoilt one fails it, one
// outside it does not.
func TestSelectionInPlace(t *testing.T) {
	_, m, _ := selectTestShard(t, codec.Zstd)
	cases := []struct {
		name string
		sel  func() (Selection, error)
	}{
		{"whole", func() (Selection, error) { return SelectTensors(m, nil) }},
		{"tensors out of order", func() (Selection, error) { return SelectTensors(m, []string{"tiny2", "none", "tiny"}) }},
		{"slices", func() (Selection, error) {
			return SelectSlices(m, []Slice{{"last", 100, 5000}, {"mid", 7, 9}, {"none", 0, 0}})
		}},
		{"nothing", func() (Selection, error) { return SelectSlices(m, []Slice{{"none", 0, 0}}) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := tc.sel()
			if err != nil {
				t.Fatal(err)
			}
			if err := m.VerifySelected(selectData, sel, "test"); err != nil {
				t.Fatal(err)
			}
			lo, size, table := sel.InPlace(m)
			span := selectData[lo : lo+size]
			for i, tn := range table {
				want := sel.Table[i]
				if tn.Name != want.Name || tn.Length != want.Length || tn.Offset+tn.Length > size {
					t.Fatalf("entry %d: %+v for %+v in a %d-byte span", i, tn, want, size)
				}
				src := tensorBytes(tn.Name)
				if tc.name == "slices" && tn.Name != "none" {
					src = map[string][]byte{"last": tensorBytes("last")[100:5100], "mid": tensorBytes("mid")[7:16]}[tn.Name]
				}
				if !bytes.Equal(span[tn.Offset:tn.Offset+tn.Length], src) {
					t.Fatalf("entry %d (%s): wrong bytes at %d of the span", i, tn.Name, tn.Offset)
				}
			}
		})
	}
	spoilt := bytes.Clone(selectData)
	spoilt[0] ^= 1 // in "big"'s first chunk
	sel, _ := SelectTensors(m, []string{"last"})
	if err := m.VerifySelected(spoilt, sel, "test"); err != nil {
		t.Fatalf("a chunk outside the selection was checked: %v", err)
	}
	sel, _ = SelectTensors(m, []string{"big"})
	if err := m.VerifySelected(spoilt, sel, "test"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a spoilt chunk of the selection: %v", err)
	}
}
