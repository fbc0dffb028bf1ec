package staging

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
)

// With PersistEvery 3, only steps 3 and 6 reach storage; the others end
// hot, restore from memory (latest included, newer than every committed
// step) without reading storage, and a sidecar that lost its memory
// restores the last persisted step.
func TestPersistEvery(t *testing.T) {
	b := faulty.New(memstore.New())
	mgr, a := newManagerOn(t, b, ManagerConfig{Tiers: tiers.Config{HotBytes: 4 << 20, HotSteps: 3, PersistEvery: 3}})
	saved := map[int64][]byte{}
	for step := int64(1); step <= 5; step++ {
		saved[step] = bytes.Repeat([]byte{byte(step)}, 100_000)
		tg := checkpoint.Target{Job: "job", Step: step, WorldSize: 1, Attempt: "a"}
		saveBytesTo(t, mgr, a, tg, saved[step])
		want := StateHot
		if step == 3 {
			want = StateCommitted
		}
		if res := settled(t, mgr, tg); res.State != want {
			t.Fatalf("step %d: %s (%v), want %s", step, res.State, res.Err, want)
		}
	}
	var stored []string
	_ = b.List(context.Background(), "job/steps/", func(oi storage.ObjectInfo) error {
		stored = append(stored, oi.Name)
		return nil
	})
	for _, name := range stored {
		if !strings.HasPrefix(name, "job/steps/000000000003/") {
			t.Fatalf("a step kept in memory reached storage: %s", name)
		}
	}
	if len(stored) != 3 { // data, manifest, commit record
		t.Fatalf("stored: %v", stored)
	}

	gets := b.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpGet, Name: "job/steps/*/a/*"})
	for _, tc := range []struct {
		step   int64
		latest bool
		want   int64
	}{{0, true, 5}, {4, false, 4}, {3, false, 3}} {
		info, h, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: tc.step, Latest: tc.latest})
		if err != nil {
			t.Fatalf("restore %+v: %v", tc, err)
		}
		got := a.Bytes()[info.Offset : info.Offset+h.Size]
		if h.Step != tc.want || h.Tier != "hot" || !bytes.Equal(got, saved[tc.want]) {
			t.Fatalf("restore %+v: step %d from %q", tc, h.Step, h.Tier)
		}
		mgr.Release(Owner{}, info.ID)
	}
	if gets.Hits() != 0 {
		t.Fatalf("restores from memory read %d shard objects", gets.Hits())
	}
	gets.Remove()
	b.Outage(faulty.OpAll) // memory-only steps need no storage at all
	if got, step, err := restoreBytes(mgr, a, 0, true); err != nil || step != 5 || !bytes.Equal(got, saved[5]) {
		t.Fatalf("latest with storage down: step %d, %v", step, err)
	}
	b.Clear()
	saved[6] = bytes.Repeat([]byte{6}, 100_000) // persisted, newer than every memory-only step
	tg := checkpoint.Target{Job: "job", Step: 6, WorldSize: 1, Attempt: "a"}
	saveBytesTo(t, mgr, a, tg, saved[6])
	settled(t, mgr, tg)
	// The drain copies a shard into the hot tier after its commit (so as
	// not to delay the commit): wait for the copy before storage goes.
	eventually(t, "step 6 in the hot tier", func() bool { s, ok := mgr.tiers.Latest("job", 0); return ok && s == 6 })
	b.Outage(faulty.OpAll)
	if got, step, err := restoreBytes(mgr, a, 0, true); err != nil || step != 6 || !bytes.Equal(got, saved[6]) {
		t.Fatalf("latest with storage down, the newest step committed: step %d, %v", step, err)
	}
	b.Clear()
	if _, _, err := restoreBytes(mgr, a, 1, false); !errors.Is(err, checkpoint.ErrStepNotFound) {
		t.Fatalf("step 1, kept in memory and evicted since: %v", err)
	}
	if n := testutil.ToFloat64(mgr.m.Tiers.WithLabelValues("hot")); n != 4 { // steps 1, 2, 4, 5
		t.Fatalf("ckptd_saves_total{tier=hot} = %v, want 4", n)
	}

	lost, la := newManagerOn(t, b, ManagerConfig{Tiers: tiers.Config{HotBytes: 4 << 20, PersistEvery: 3}})
	if got, step, err := restoreBytes(lost, la, 0, true); err != nil || step != 6 || !bytes.Equal(got, saved[6]) {
		t.Fatalf("latest after the memory was lost: step %d, %v", step, err)
	}
}

// A save is reported at the strongest tier it reached: a memory tier
// arriving late (its replication ending after a peer's word had it
// persisted) does not hide that it is durable, nor keep it from
// committing.
func TestStrongestTierWins(t *testing.T) {
	mgr, _ := newManagerOn(t, memstore.New(), ManagerConfig{Tiers: tiers.Config{HotBytes: 1 << 20, PersistEvery: 2}})
	k := saveKey{"job", 3, 0, "a"}
	mgr.saves.set(k, StateDurable, nil)
	mgr.markDone(k, StateReplicated, nil)
	if res, _, _ := mgr.saves.status(&k); res.State != StateDurable {
		t.Fatalf("durable, then replicated: %s", res.State)
	}
	mgr.markDone(k, StateCommitted, nil)
	if res, _, _ := mgr.saves.status(&k); res.State != StateCommitted || !res.final {
		t.Fatalf("then committed: %s", res.State)
	}
}
