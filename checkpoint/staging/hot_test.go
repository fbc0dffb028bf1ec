package staging

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/faulty"
	"github.com/ckptd/ckptd/storage/memstore"
)

// hotSave saves and commits step (one rank) and returns its bytes.
func hotSave(t *testing.T, mgr *Manager, a arenaBytes, step int64) []byte {
	t.Helper()
	data := bytes.Repeat([]byte{byte(step)}, 100_000)
	tg := checkpoint.Target{Job: "job", Step: step, WorldSize: 1, Attempt: "a"}
	saveBytesTo(t, mgr, a, tg, data)
	if res := settled(t, mgr, tg); res.State != StateCommitted {
		t.Fatalf("step %d: %s (%v)", step, res.State, res.Err)
	}
	if mgr.tiers.HotEnabled() { // the drain keeps its hot copy once the commit is settled, a moment later
		eventually(t, fmt.Sprintf("step %d in the hot tier", step), func() bool {
			src, ok := mgr.tiers.Hot("job", step, 0, "a")
			src.Release()
			return ok
		})
	}
	return data
}

// restoreBytes restores rank 0 of step (latest: the newest) and returns
// its bytes.
func restoreBytes(mgr *Manager, a arenaBytes, step int64, latest bool) ([]byte, int64, error) {
	info, h, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: step, Latest: latest})
	if err != nil {
		return nil, 0, err
	}
	defer mgr.Release(Owner{}, info.ID)
	return bytes.Clone(a.Bytes()[info.Offset : info.Offset+h.Size]), h.Step, nil
}

// The newest steps restore from memory: no data object is read, and they
// restore with storage down (the newest for latest); older steps and a
// daemon without a hot tier read storage.
func TestHotTier(t *testing.T) {
	b := faulty.New(memstore.New())
	mgr, a := newManagerOn(t, b, ManagerConfig{Tiers: tiers.Config{HotBytes: 1 << 20, HotSteps: 2}})
	var saved [4][]byte
	for step := int64(1); step <= 3; step++ {
		saved[step] = hotSave(t, mgr, a, step)
	}
	dataGets := b.Inject(faulty.Fault{Kind: faulty.Fail, Ops: faulty.OpGet, Name: "job/steps/*/a/rank-*.data"})
	for step := int64(2); step <= 3; step++ {
		got, _, err := restoreBytes(mgr, a, step, false)
		if err != nil || !bytes.Equal(got, saved[step]) {
			t.Fatalf("hot step %d: %v", step, err)
		}
	}
	if dataGets.Hits() != 0 {
		t.Fatalf("hot restores read %d data objects", dataGets.Hits())
	}
	if _, _, err := restoreBytes(mgr, a, 1, false); !errors.Is(err, storage.ErrUnavailable) {
		t.Fatalf("step 1, evicted (2 hot steps), restored without storage: %v", err)
	}
	dataGets.Remove()

	b.Outage(faulty.OpAll)
	if got, step, err := restoreBytes(mgr, a, 0, true); err != nil || step != 3 || !bytes.Equal(got, saved[3]) {
		t.Fatalf("latest with storage down: step %d, %v", step, err)
	}
	if got, _, err := restoreBytes(mgr, a, 2, false); err != nil || !bytes.Equal(got, saved[2]) {
		t.Fatalf("step 2 with storage down: %v", err)
	}
	b.Clear()

	cold, ca := newManagerOn(t, b, ManagerConfig{})
	hotSave(t, cold, ca, 4)
	b.Outage(faulty.OpAll)
	if _, _, err := restoreBytes(cold, ca, 4, false); !errors.Is(err, storage.ErrUnavailable) {
		t.Fatalf("no hot tier, storage down: %v", err)
	}
}

// A hot copy that no longer matches its chunk hashes is refused as
// corrupt, like damaged storage; a shard larger than the budget is not
// kept.
func TestHotTierVerifies(t *testing.T) {
	b := memstore.New()
	mgr, a := newManagerOn(t, b, ManagerConfig{Tiers: tiers.Config{HotBytes: 150_000}})
	hotSave(t, mgr, a, 1)
	_, data, _, release, err := mgr.tiers.Replica("job", 1, 0, "a") // the hot copy's own bytes: there, hotSave waited for it
	if err != nil {
		t.Fatal(err)
	}
	data[10] ^= 1
	release()
	if _, _, err := restoreBytes(mgr, a, 1, false); !errors.Is(err, checkpoint.ErrCorrupt) {
		t.Fatalf("a damaged hot copy: %v", err)
	}
	big := bytes.Repeat([]byte{7}, 200_000)
	tg := checkpoint.Target{Job: "job", Step: 2, WorldSize: 1, Attempt: "a"}
	saveBytesTo(t, mgr, a, tg, big)
	settled(t, mgr, tg)
	if used, _, _ := mgr.tiers.Stats(); used > 150_000 {
		t.Fatalf("hot tier holds %d bytes over its 150000 budget", used)
	}
}

// A restore of some tensors of a shard hands out exactly those, in the
// order asked, from storage and from the hot tier; an unknown name is
// refused.
func TestPartialRestore(t *testing.T) {
	for _, hot := range []int64{0, 8 << 20} {
		mgr, a := newManagerOn(t, memstore.New(), ManagerConfig{Tiers: tiers.Config{HotBytes: hot}, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}})
		sizes := map[string]int64{"a": 300_000, "b": 500_000, "c": 70_000}
		var table []checkpoint.Tensor
		var off int64
		for _, name := range []string{"a", "b", "c"} {
			table = append(table, u8(name, off, sizes[name]))
			off += sizes[name]
		}
		tg := checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}
		info, err := mgr.BeginSave(context.Background(), Owner{}, tg, table)
		if err != nil {
			t.Fatal(err)
		}
		data := a.Bytes()[info.Offset : info.Offset+off]
		for i := range data {
			data[i] = byte(i * 7)
		}
		want := bytes.Clone(data)
		if _, _, err := mgr.CommitSave(Owner{}, info.ID, nil, nil); err != nil {
			t.Fatal(err)
		}
		settled(t, mgr, tg)
		ri, h, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1, Tensors: []string{"c", "a"}})
		if err != nil {
			t.Fatal(err)
		}
		got := a.Bytes()[ri.Offset : ri.Offset+h.Size]
		if h.Size != 370_000 || len(h.Tensors) != 2 || h.Tensors[0].Name != "c" || h.Tensors[1].Offset != 70_000 ||
			!bytes.Equal(got[:70_000], want[800_000:]) || !bytes.Equal(got[70_000:], want[:300_000]) {
			t.Fatalf("hot %d: partial restore: %+v", hot, h.Tensors)
		}
		mgr.Release(Owner{}, ri.ID)
		if _, _, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Job: "job", Step: 1, Tensors: []string{"nope"}}); !errors.Is(err, checkpoint.ErrInvalid) {
			t.Fatalf("an unknown tensor: %v", err)
		}
	}
}
