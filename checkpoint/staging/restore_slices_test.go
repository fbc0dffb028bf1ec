package staging

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/memstore"
)

// dataReads counts the Gets of a store's chunk data objects.
type dataReads struct {
	storage.Backend
	n atomic.Int64
}

func (d *dataReads) Get(ctx context.Context, name string, off, n int64) (io.ReadCloser, error) {
	if strings.HasSuffix(name, ".data") {
		d.n.Add(1)
	}
	return d.Backend.Get(ctx, name, off, n)
}

// A restore of byte slices of tensors hands out exactly those bytes, in
// the order asked, from storage and from the hot tier; a header-only
// restore hands out the metadata and reads no chunk; slices that overlap
// or name no tensor, and a restore naming both tensors and slices, are
// refused.
func TestSliceAndHeaderRestore(t *testing.T) {
	for _, hot := range []int64{0, 8 << 20} {
		store := &dataReads{Backend: memstore.New()}
		mgr, a := newManagerOn(t, store, ManagerConfig{Tiers: tiers.Config{HotBytes: hot}, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}})
		table := []checkpoint.Tensor{u8("a", 0, 300_000), u8("b", 300_000, 500_000)}
		tg := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
		info, err := mgr.BeginSave(context.Background(), Owner{}, tg, table)
		if err != nil {
			t.Fatal(err)
		}
		data := a.Bytes()[info.Offset : info.Offset+800_000]
		for i := range data {
			data[i] = byte(i * 7)
		}
		want := bytes.Clone(data)
		if _, _, err := mgr.CommitSave(Owner{}, info.ID, []byte("md"), nil); err != nil {
			t.Fatal(err)
		}
		settled(t, mgr, tg)
		slices := []checkpoint.Slice{{Name: "b", Offset: 100_000, Length: 200_000}, {Name: "a", Offset: 7, Length: 3}}
		ri, h, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1, Slices: slices})
		if err != nil {
			t.Fatal(err)
		}
		got := a.Bytes()[ri.Offset : ri.Offset+h.Size]
		if h.Size != 200_003 || len(h.Tensors) != 2 || h.Tensors[0].Name != "b" || h.Tensors[1].Offset != 200_000 || h.Tensors[1].Length != 3 ||
			!bytes.Equal(got[:200_000], want[400_000:600_000]) || !bytes.Equal(got[200_000:], want[7:10]) {
			t.Fatalf("hot %d: slices: %+v", hot, h.Tensors)
		}
		mgr.Release(Owner{}, ri.ID)
		before := store.n.Load()
		ri, h, err = mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1, HeaderOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		if h.Size != 0 || len(h.Tensors) != 0 || string(h.Metadata) != "md" || store.n.Load() != before {
			t.Fatalf("hot %d: header only: %+v, %d chunk reads", hot, h, store.n.Load()-before)
		}
		mgr.Release(Owner{}, ri.ID)
		for _, bad := range []RestoreRequest{
			{Slices: []checkpoint.Slice{{Name: "a", Offset: 0, Length: 10}, {Name: "a", Offset: 9, Length: 1}}},
			{Slices: []checkpoint.Slice{{Name: "nope", Offset: 0, Length: 1}}},
			{Slices: []checkpoint.Slice{{Name: "a", Offset: 0, Length: 1}}, Tensors: []string{"b"}},
			{HeaderOnly: true, Tensors: []string{"b"}},
		} {
			bad.Job, bad.Step = "job", 1
			if _, _, err := mgr.BeginRestore(context.Background(), Owner{}, bad); !errors.Is(err, checkpoint.ErrInvalid) {
				t.Fatalf("hot %d: %+v: %v", hot, bad, err)
			}
		}
	}
}
