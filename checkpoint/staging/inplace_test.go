package staging

import (
	"bytes"
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/storage/memstore"
)

// inPlaceBytes reads a lease in place as a client does: from the hot
// mapping's file at the lease's offset.
func inPlaceBytes(t *testing.T, pool *arena.Pool, info LeaseInfo, n int64) []byte {
	t.Helper()
	if info.ArenaID != pool.ID() {
		t.Fatalf("lease in arena %q, want the hot mapping %q", info.ArenaID, pool.ID())
	}
	f, err := os.Open(pool.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, info.Offset); err != nil {
		t.Fatal(err)
	}
	return b
}

// A restore from the hot tier that asks for it is handed the hot copy
// where it lies in the hot mapping (whole, or the span of the tensors
// asked for, the table pointing into it), which its lease keeps from
// being dropped until released; without asking, the copy is in the arena.
func TestRestoreInPlace(t *testing.T) {
	pool, err := arena.OpenPool(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	mgr, a := newManagerOn(t, memstore.New(), ManagerConfig{Tiers: tiers.Config{HotBytes: 1 << 20, HotSteps: 1}, HotMapping: pool})
	data := make([]byte, 3000)
	for i := range data {
		data[i] = byte(i * 7)
	}
	tg := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
	saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 1000), u8("b", 1000, 1000), u8("c", 2000, 1000)})
	eventually(t, "step 1 in the hot tier", func() bool { return holdsHot(mgr, 1) })
	ctx := context.Background()

	whole, h, err := mgr.BeginRestore(ctx, Owner{}, RestoreRequest{Job: "job", Step: 1, InPlace: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := inPlaceBytes(t, pool, whole, h.Size); h.Tier != "hot" || !h.InPlace || !bytes.Equal(got, data) {
		t.Fatalf("whole restore in place from %s: %d bytes differ", h.Tier, len(got))
	}

	some, h, err := mgr.BeginRestore(ctx, Owner{}, RestoreRequest{Job: "job", Step: 1, Tensors: []string{"c", "a"}, InPlace: true})
	if err != nil {
		t.Fatal(err)
	}
	span := inPlaceBytes(t, pool, some, h.Size)
	if !h.InPlace || h.Size != 3000 {
		t.Fatalf("tensors c and a in place: a span of %d bytes (in place: %v), want 3000", h.Size, h.InPlace)
	}
	for _, tn := range h.Tensors {
		want := data[map[string]int{"a": 0, "c": 2000}[tn.Name]:][:1000]
		if got := span[tn.Offset : tn.Offset+tn.Length]; !bytes.Equal(got, want) {
			t.Fatalf("tensor %s at %d of the span: wrong bytes", tn.Name, tn.Offset)
		}
	}

	copied, h, err := mgr.BeginRestore(ctx, Owner{}, RestoreRequest{Job: "job", Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	if copied.ArenaID != "" || h.InPlace || !bytes.Equal(a.Bytes()[copied.Offset:copied.Offset+h.Size], data) {
		t.Fatalf("a restore not in place: arena %q, or wrong bytes", copied.ArenaID)
	}
	mgr.Release(Owner{}, copied.ID)

	// Step 2 would replace step 1 (one step kept), but the leases in
	// place pin it; once they end, step 3 does.
	tg.Step = 2
	saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 3000)})
	eventually(t, "step 2 in the hot tier", func() bool { return holdsHot(mgr, 2) })
	if !holdsHot(mgr, 1) {
		t.Fatal("a hot copy leased in place was dropped")
	}
	if got := inPlaceBytes(t, pool, whole, int64(len(data))); !bytes.Equal(got, data) {
		t.Fatal("a hot copy leased in place changed under its lease")
	}
	mgr.Release(Owner{}, whole.ID)
	mgr.Release(Owner{}, some.ID)
	tg.Step = 3
	saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 3000)})
	eventually(t, "step 1 dropped once unpinned", func() bool { return !holdsHot(mgr, 1) })
}

// holdsHot reports whether mgr's hot tier holds rank 0 of step of "job".
func holdsHot(mgr *Manager, step int64) bool {
	src, ok := mgr.tiers.Hot("job", step, 0, "a")
	src.Release()
	return ok
}

// saveTensors saves data as tensors of tg through mgr, as a client would,
// and waits for it to commit.
func saveTensors(t *testing.T, mgr *Manager, a arenaBytes, tg checkpoint.Target, data []byte, tensors []checkpoint.Tensor) {
	t.Helper()
	info, err := mgr.BeginSave(context.Background(), Owner{}, tg, tensors)
	if err != nil {
		t.Fatal(err)
	}
	copy(a.Bytes()[info.Offset:], data)
	if _, _, err := mgr.CommitSave(Owner{}, info.ID, nil, nil); err != nil {
		t.Fatal(err)
	}
	if res := settled(t, mgr, tg); res.State != StateCommitted {
		t.Fatalf("step %d: %s (%v)", tg.Step, res.State, res.Err)
	}
}

// A lease in place that expires while its client is connected keeps the
// hot copy pinned (the client may still be copying out of it), as an
// expired region is kept; once the client goes, the copy may go too.
func TestExpiredInPlaceLeaseKeepsItsPin(t *testing.T) {
	pool, err := arena.OpenPool(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	mgr, a := newManagerOn(t, memstore.New(), ManagerConfig{LeaseTimeout: 50 * time.Millisecond,
		Tiers: tiers.Config{HotBytes: 1 << 20, HotSteps: 1}, HotMapping: pool})
	data := bytes.Repeat([]byte{7}, 3000)
	tg := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
	saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 3000)})
	eventually(t, "step 1 in the hot tier", func() bool { return holdsHot(mgr, 1) })
	done := make(chan struct{})
	o := Owner{ID: "trainer", Done: done}
	info, _, err := mgr.BeginRestore(context.Background(), o, RestoreRequest{Job: "job", Step: 1, InPlace: true})
	if err != nil || info.ArenaID != pool.ID() {
		t.Fatalf("restore in place: %v (arena %q)", err, info.ArenaID)
	}
	eventually(t, "the lease expired", func() bool {
		_, err := mgr.Bytes(o, info.ID)
		return errors.Is(err, ErrUnknownLease)
	})
	tg.Step = 2
	saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 3000)})
	eventually(t, "step 2 in the hot tier", func() bool { return holdsHot(mgr, 2) })
	if !holdsHot(mgr, 1) {
		t.Fatal("the hot copy of an expired lease of a connected client was dropped")
	}
	close(done)
	tg.Step = 3
	eventually(t, "step 1 dropped once its reader went", func() bool {
		if holdsHot(mgr, 3) {
			return !holdsHot(mgr, 1)
		}
		saveTensors(t, mgr, a, tg, data, []checkpoint.Tensor{u8("a", 0, 3000)})
		return false
	})
}
