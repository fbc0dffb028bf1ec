package checkpoint

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// randomLayout is a table of tensors of mixed dtypes and sizes (some
// empty) with gaps between them, and a region holding a byte pattern.
func randomLayout(t *testing.T, r *rand.Rand) (*Layout, []byte) {
	t.Helper()
	var ts []Tensor
	var off int64
	for i := range 1 + r.IntN(20) {
		dt := []dtype.DType{dtype.F32, dtype.BF16, dtype.U8}[r.IntN(3)]
		n := int64(r.IntN(3)) * int64(r.IntN(30000)) // a third empty
		n -= n % int64(dt.Size())
		ts = append(ts, Tensor{Name: fmt.Sprintf("t%d", i), DType: dt, Shape: []int64{n / int64(dt.Size())}, Offset: off, Length: n})
		off += n + int64(r.IntN(3))*8
	}
	l, err := NewLayout(ts)
	if err != nil {
		t.Fatal(err)
	}
	region := make([]byte, l.RegionSize)
	for i := range region {
		region[i] = byte(r.Uint32())
	}
	return l, region
}

// The chunks a CopyCheck's ends describe are the writer's chunks, and a
// RegionHasher fed the region in pieces of any size hashes each chunk of
// the data space as a client does.
func TestCopyCheckChunks(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 200 {
		l, region := randomLayout(t, r)
		alone := []int64{0, 1024}[i%2]
		ends := l.checkEnds(4096, alone)
		if p, q := l.planEnds(ends), l.planChunks(4096, alone); len(p)+len(q) > 0 && !reflect.DeepEqual(p, q) {
			t.Fatalf("layout %d: planEnds differs from planChunks:\n%+v\n%+v", i, p, q)
		}
		data := make([]byte, l.DataSize)
		l.Pack(region, data)
		c := NewCopyCheck(ends)
		want, err := Sums(c.Key, ends, data)
		if err != nil {
			t.Fatal(err)
		}
		h := NewRegionHasher(l, c)
		for rest := region; len(rest) > 0; {
			n := min(len(rest), 1+r.IntN(9000))
			_, _ = h.Write(rest[:n])
			rest = rest[n:]
		}
		got, err := h.Sums()
		if err != nil || !reflect.DeepEqual(got, want) && len(want) > 0 {
			t.Fatalf("layout %d: region hashes %v, %v; want %v", i, got, err, want)
		}
		c.Hashes = want
		if err := c.Validate(l, true); err != nil {
			t.Fatal(err)
		}
	}
}

// Ends that do not cut the data space into chunks, and hashes that do not
// fit them, are refused.
func TestCopyCheckValidate(t *testing.T) {
	l, err := NewLayout([]Tensor{{Name: "a", DType: dtype.U8, Shape: []int64{10000}, Length: 10000}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ends   []int64
		hashes int
	}{
		{nil, 0}, {[]int64{5000}, 1}, {[]int64{5000, 5000, 10000}, 3}, {[]int64{-1, 10000}, 2},
		{[]int64{10000, 20000}, 2}, {[]int64{10000}, 0}, {[]int64{10000}, 2},
	} {
		c := &CopyCheck{Ends: tc.ends, Key: codec.NewMACKey(), Hashes: make([]uint64, tc.hashes)}
		if err := c.Validate(l, true); !errors.Is(err, ErrInvalid) {
			t.Errorf("ends %v with %d hashes: %v", tc.ends, tc.hashes, err)
		}
	}
	if err := (&CopyCheck{Ends: []int64{10000}, Key: []byte("short"), Hashes: []uint64{0}}).Validate(l, true); !errors.Is(err, ErrInvalid) {
		t.Errorf("a short key: %v", err)
	}
}

// A checked selection restores whole chunks that hash as the check says,
// with each selected tensor or slice where its table says, holding the
// bytes the plain selection holds.
func TestCheckedSelection(t *testing.T) {
	store, m, _ := selectTestShard(t, codec.Zstd)
	whole, _ := SelectTensors(m, nil)
	some, _ := SelectTensors(m, []string{"tiny2", "none", "big"})
	parts, _ := SelectSlices(m, []Slice{{"mid", 1000, 70_000}, {"last", 0, 8}, {"big", 300_000, 9}, {"tiny", 1, 0}})
	for name, sel := range map[string]Selection{"whole": whole, "tensors": some, "slices": parts} {
		want := make([]byte, sel.Size)
		if err := store.ReadSelected(context.Background(), m, sel, want, ReadOptions{}); err != nil {
			t.Fatal(err)
		}
		wide, check := sel.Checked(m)
		got := make([]byte, wide.Size)
		if err := store.ReadSelected(context.Background(), m, wide, got, ReadOptions{}); err != nil {
			t.Fatal(err)
		}
		var start int64
		for i, end := range check.Ends { // whole chunks, as stored
			if c := m.Chunks[sel.chunks(m)[i]]; end-start != c.Raw || codec.HashString(got[start:end]) != c.Hash {
				t.Fatalf("%s: chunk %d of the restored bytes is not a stored chunk", name, i)
			}
			start = end
		}
		if start != wide.Size || len(wide.Table) != len(sel.Table) {
			t.Fatalf("%s: checks end at %d of %d bytes; %d tensors for %d", name, start, wide.Size, len(wide.Table), len(sel.Table))
		}
		for j, tw := range wide.Table {
			ts := sel.Table[j]
			if tw.Name != ts.Name || tw.Length != ts.Length || !bytes.Equal(got[tw.Offset:tw.Offset+tw.Length], want[ts.Offset:ts.Offset+ts.Length]) {
				t.Fatalf("%s: tensor %d (%s) differs", name, j, ts.Name)
			}
		}
	}
}

// CopySelected hands out what ReadSelected does from a shard held in
// memory, and refuses a damaged chunk only where the selection touches it.
func TestCopySelectedInMemory(t *testing.T) {
	store, m, _ := selectTestShard(t, codec.None)
	data := bytes.Clone(selectData)
	sel, _ := SelectSlices(m, []Slice{{"mid", 1000, 70_000}, {"big", 300_000, 9}, {"tiny", 1, 2}})
	want := make([]byte, sel.Size)
	if err := store.ReadSelected(context.Background(), m, sel, want, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, sel.Size)
	if err := m.CopySelected(data, sel, got, "test"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("copied %v", err)
	}
	data[10] ^= 1 // in the first chunk: "big" starts there, but the slices do not touch it
	if err := m.CopySelected(data, sel, got, "test"); err != nil {
		t.Fatalf("an untouched chunk was checked: %v", err)
	}
	data[300_004] ^= 1
	if err := m.CopySelected(data, sel, got, "test"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a damaged chunk: %v", err)
	}
}
