package server

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
)

// The adapters hand the arena's regions and journal entries over as they
// are, and its Alloc errors match the checkpoint sentinels with their
// message unchanged.
func TestArenaAdapters(t *testing.T) {
	a, err := arena.Open(arena.Options{Dir: t.TempDir(), Size: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ca, pa := CheckpointArena(a), PrefetchArena(a)
	ctx := context.Background()
	r, err := ca.Alloc(ctx, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Free(arena.Region(r)); err != nil {
		t.Fatalf("the arena does not know the region the checkpoint adapter gave: %v", err)
	}
	if err := ca.Reserve(r); err != nil {
		t.Fatal(err)
	}
	pr, err := pa.Alloc(ctx, 1<<20)
	if err != nil || pr.Offset < r.Offset+r.Length {
		t.Fatalf("prefetch region %v after the reserved %v: %v", pr, r, err)
	}
	if err := pa.Free(pr); err != nil {
		t.Fatal(err)
	}
	if err := ca.Free(r); err != nil || a.Used() != 0 {
		t.Fatalf("free: %v; %d bytes still used", err, a.Used())
	}

	if err := ca.Journal().Put("e1", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if es, err := ca.Journal().List(); err != nil || len(es) != 1 || es[0].ID != "e1" || string(es[0].Data) != "x" {
		t.Fatalf("journal list: %v %v", es, err)
	}

	_, err = ca.Alloc(ctx, 8<<20)
	_, direct := a.Alloc(ctx, 8<<20)
	if !errors.Is(err, staging.ErrArenaTooLarge) || !errors.Is(err, arena.ErrTooLarge) || err.Error() != direct.Error() {
		t.Fatalf("too large: %v", err)
	}
	full, err := ca.Alloc(ctx, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Free(full)
	tctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	if _, err := ca.Alloc(tctx, 1); !errors.Is(err, staging.ErrArenaFull) || !errors.Is(err, arena.ErrFull) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("full: %v", err)
	}
}
