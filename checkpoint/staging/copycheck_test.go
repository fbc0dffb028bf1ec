package staging

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/memstore"
)

// copyHashes is what a client sends for a checked copy: the MAC of each
// chunk of the data space (data, the tensors back to back) that c cuts.
func copyHashes(data []byte, c *checkpoint.CopyCheck) []uint64 {
	out, err := checkpoint.Sums(c.Key, c.Ends, data)
	if err != nil {
		panic(err)
	}
	return out
}

// checkedTable is two tensors with a gap between them, so that the region
// and the data space differ: the hashes are of the data space.
func checkedTable() ([]checkpoint.Tensor, []byte) {
	data := make([]byte, 300_000)
	for i := range data {
		data[i] = byte(i * 31)
	}
	return []checkpoint.Tensor{u8("a", 0, 100_000), u8("b", 100_064, 200_000)}, data
}

// stageChecked leases and fills a save as a client of a shared arena
// does, and commits it with hashes (or with the hashes it is given).
func stageChecked(t *testing.T, mgr *Manager, a arenaBytes, tg checkpoint.Target, hashes func(ends []int64) []uint64) (region []byte, err error) {
	t.Helper()
	table, data := checkedTable()
	info, err := mgr.BeginSave(context.Background(), Owner{}, tg, table)
	if err != nil {
		t.Fatal(err)
	}
	if info.Check == nil || len(info.Check.Ends) == 0 || info.Check.Ends[len(info.Check.Ends)-1] != int64(len(data)) {
		t.Fatalf("check %+v for %d bytes", info.Check, len(data))
	}
	region = a.Bytes()[info.Offset : info.Offset+info.Length]
	copy(region, data[:100_000])
	copy(region[100_064:], data[100_000:])
	if _, _, err := mgr.CommitSave(Owner{}, info.ID, nil, nil); !errors.Is(err, checkpoint.ErrInvalid) {
		t.Fatalf("a commit without hashes: %v", err)
	}
	h := copyHashes(data, info.Check)
	if hashes != nil {
		h = hashes(info.Check.Ends)
	}
	_, _, err = mgr.CommitSave(Owner{}, info.ID, nil, h)
	return region, err
}

// With CheckCopies a save is stored only as its client copied it: bytes
// rewritten in the arena after the copy (by another user of a shared
// arena) fail the save, from the drain to storage and into the hot tier
// alike, and nothing of it is committed.
func TestCheckedCopies(t *testing.T) {
	for _, tc := range []struct {
		name    string
		memory  bool // the step is kept in memory, not persisted
		rewrite bool
		want    State
	}{
		{"stored", false, false, StateCommitted},
		{"stored, rewritten", false, true, StateFailed},
		{"in memory", true, false, StateHot},
		{"in memory, rewritten", true, true, StateFailed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ManagerConfig{CheckCopies: true, DrainDelay: 100 * time.Millisecond, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}}
			if tc.memory {
				cfg.Tiers = tiers.Config{HotBytes: 4 << 20, PersistEvery: 1000}
			}
			b := memstore.New()
			mgr, a := newManagerOn(t, b, cfg)
			tg := target(7)
			if tc.memory { // the policy persists a job's first step: make this the second
				saveChecked(t, mgr, a, target(6))
			}
			region, err := stageChecked(t, mgr, a, tg, nil)
			if err != nil {
				t.Fatal(err)
			}
			if tc.rewrite {
				region[150_000] ^= 0xff // in the drain's delay, as a spinning attacker would
			}
			res := settled(t, mgr, tg)
			if res.State != tc.want || (tc.rewrite && !errors.Is(res.Err, checkpoint.ErrStagedChanged)) {
				t.Fatalf("state %v, err %v; want %v", res.State, res.Err, tc.want)
			}
			if _, _, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Step: 7}); tc.rewrite && err == nil {
				t.Fatal("a rewritten save can be restored")
			}
			if n := mgr.m.ErrorCounts()["copy_check"]; tc.rewrite != (n == 1) {
				t.Fatalf("%d copy check failures counted", n)
			}
			var left []string // a refused save leaves no data behind
			_ = b.List(context.Background(), "job/", func(o storage.ObjectInfo) error {
				if strings.Contains(o.Name, "/000000000007/") {
					left = append(left, o.Name)
				}
				return nil
			})
			if tc.rewrite && len(left) > 0 || tc.want == StateCommitted && len(left) == 0 {
				t.Fatalf("step 7 in storage: %v", left)
			}
		})
	}
}

func saveChecked(t *testing.T, mgr *Manager, a arenaBytes, tg checkpoint.Target) {
	t.Helper()
	if _, err := stageChecked(t, mgr, a, tg, nil); err != nil {
		t.Fatal(err)
	}
	if res := settled(t, mgr, tg); res.State == StateFailed {
		t.Fatal(res.Err)
	}
}

// Hashes that do not fit the lease's chunks are refused at commit; hashes
// of other bytes fail the save at drain.
func TestCheckedCopyWrongHashes(t *testing.T) {
	mgr, a := newManagerOn(t, memstore.New(), ManagerConfig{CheckCopies: true, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}})
	if _, err := stageChecked(t, mgr, a, target(1), func(ends []int64) []uint64 { return make([]uint64, len(ends)+1) }); !errors.Is(err, checkpoint.ErrInvalid) {
		t.Fatalf("one hash too many: %v", err)
	}
	if _, err := stageChecked(t, mgr, a, target(2), func(ends []int64) []uint64 { return make([]uint64, len(ends)) }); err != nil {
		t.Fatal(err)
	}
	if res := settled(t, mgr, target(2)); res.State != StateFailed || !errors.Is(res.Err, checkpoint.ErrStagedChanged) {
		t.Fatalf("hashes of other bytes: %v %v", res.State, res.Err)
	}
}

// A streamed save is checked too: the daemon hashes the stream on its way
// into the arena.
func TestCheckedStream(t *testing.T) {
	mgr, _ := newManagerOn(t, memstore.New(), ManagerConfig{CheckCopies: true, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}})
	table, data := checkedTable()
	stream := append(append(bytes.Clone(data[:100_000]), make([]byte, 64)...), data[100_000:]...)
	if _, _, err := mgr.SaveFrom(context.Background(), Owner{}, target(3), table, nil, bytes.NewReader(stream)); err != nil {
		t.Fatal(err)
	}
	if res := settled(t, mgr, target(3)); res.State != StateCommitted {
		t.Fatalf("streamed save: %v %v", res.State, res.Err)
	}
	if _, _, err := mgr.SaveFrom(context.Background(), Owner{}, target(4), table, nil, bytes.NewReader(stream[:1000])); !errors.Is(err, checkpoint.ErrInvalid) {
		t.Fatalf("short stream: %v", err)
	}
}

// With CheckCopies a restore hands out whole chunks and what they hash
// to, so that the client can check its copy; the table still finds each
// tensor.
func TestCheckedRestore(t *testing.T) {
	mgr, a := newManagerOn(t, memstore.New(), ManagerConfig{CheckCopies: true, Writer: checkpoint.WriterOptions{ChunkSize: 64 << 10}})
	saveChecked(t, mgr, a, target(1))
	_, data := checkedTable()
	for _, names := range [][]string{nil, {"b"}} {
		info, h, err := mgr.BeginRestore(context.Background(), Owner{}, RestoreRequest{Step: 1, Tensors: names})
		if err != nil {
			t.Fatal(err)
		}
		got := a.Bytes()[info.Offset : info.Offset+h.Size]
		if h.Check == nil || !slices.Equal(copyHashes(got, h.Check), h.Check.Hashes) {
			t.Fatalf("%v: restored bytes do not hash as the header says (%+v)", names, h.Check)
		}
		b := h.Tensors[len(h.Tensors)-1]
		if !bytes.Equal(got[b.Offset:b.Offset+b.Length], data[100_000:]) {
			t.Fatalf("%v: tensor b is not where the table says", names)
		}
		mgr.Release(Owner{}, info.ID)
	}
}

// A save journaled by a Manager that did not check copies, replayed by one
// that does (a restart with --socket-group), is checked from its bytes as
// the restart found them: it drains, and a rewrite afterwards fails it.
func TestCheckedReplay(t *testing.T) {
	b := memstore.New()
	for _, rewrite := range []bool{false, true} {
		mgr, a := newManagerOn(t, b, ManagerConfig{DrainDelay: time.Hour})
		tg := target(1)
		if rewrite {
			tg = target(2)
		}
		saveBytes(t, mgr, a, tg, bytes.Repeat([]byte{9}, 300_000))
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		if n := mgr.Close(ctx); n != 1 {
			t.Fatalf("%d saves left journaled", n)
		}
		cancel()
		a.Close()
		a2, err := arena.Open(arena.Options{Dir: filepath.Dir(a.Path()), Size: 8 << 20})
		if err != nil {
			t.Fatal(err)
		}
		mgr2, err := NewManager(shmArena{a2}, b, ManagerConfig{DefaultJob: "job", CheckCopies: true, DrainDelay: 200 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if rewrite {
			a2.Bytes()[1000] ^= 1
		}
		want := map[bool]State{false: StateCommitted, true: StateFailed}[rewrite]
		if res := settled(t, mgr2, tg); res.State != want {
			t.Fatalf("rewrite %v: %v %v", rewrite, res.State, res.Err)
		}
		mgr2.Close(context.Background())
		a2.Close()
	}
}
