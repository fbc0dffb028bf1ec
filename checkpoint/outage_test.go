package checkpoint

import (
	"context"
	"errors"
	"testing"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
)

// A restore during a storage outage is reported as the outage, not as
// corrupt data (a trainer would give up on a good checkpoint), and works
// once storage is back; real damage is still ErrCorrupt.
func TestRestoreDuringOutage(t *testing.T) {
	b := faulty.New(memstore.New())
	sh := shardOf("run", 1, 0, 1)
	save(t, b, sh)
	store, _ := NewStore(b, "job")
	rec, err := store.Resolve(context.Background(), 1, false)
	if err != nil {
		t.Fatal(err)
	}
	m, err := store.Manifest(context.Background(), rec, 0)
	if err != nil {
		t.Fatal(err)
	}
	restore := func() error {
		return store.ReadShard(context.Background(), m, make(BufferSink, m.DataSize), ReadOptions{})
	}
	outage := b.Outage(faulty.OpGet)
	err = restore()
	var ce *ChunkError
	if !errors.Is(err, storage.ErrUnavailable) || errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) || ce.Rank != 0 {
		t.Fatalf("restore during an outage: %v", err)
	}
	outage.Remove()
	if err := restore(); err != nil {
		t.Fatalf("restore after the outage: %v", err)
	}
	b.Inject(faulty.Fault{Kind: faulty.CorruptRead, Ops: faulty.OpGet, N: 100})
	if err := restore(); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("restore of flipped bytes: %v", err)
	}
}
