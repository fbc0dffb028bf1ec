package tiers

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/internal/arena"
)

// shard is a manifest of n bytes of one u8 tensor of job's step by rank
// and attempt "a", and its data space filled with fill.
func shard(job string, step int64, rank int, n int64, fill byte) (*checkpoint.Manifest, []byte) {
	m := &checkpoint.Manifest{Format: checkpoint.ManifestFormat, Version: checkpoint.ManifestVersion, Job: job, Step: step,
		Rank: rank, WorldSize: rank + 1, Attempt: "a", DataSize: n,
		Tensors: []checkpoint.Tensor{{Name: "w", DType: dtype.U8, Shape: []int64{n}, Length: n}}}
	data := make([]byte, n)
	for i := range data {
		data[i] = fill
	}
	m.Metadata = []byte{fill} // other bytes, another manifest
	return m, data
}

// keep keeps a shard in h as a drain (origin) or a peer (replica) would,
// through a buffer of h's; it reports what insert said, or errNoRoom.
func keep(h *hotTier, m *checkpoint.Manifest, data []byte, f hotFlags) error {
	b, ok := h.buffer(keyOf(m), m.DataSize)
	if !ok {
		return errNoRoomTest
	}
	copy(b, data)
	release, err := h.insert(m, b, f)
	release()
	return err
}

var errNoRoomTest = errors.New("no room")

// checkBudget fails unless the tier counts every buffer it has by its
// capacity, within the budget.
func checkBudget(t *testing.T, h *hotTier) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	var held int64
	for _, e := range h.entries {
		held += int64(cap(e.data))
	}
	for _, b := range h.spares {
		held += int64(cap(b))
	}
	if held != h.used || h.used > h.budget {
		t.Fatalf("the tier holds %d bytes of buffers, counts %d, of a budget of %d", held, h.used, h.budget)
	}
}

// Dropped shards' buffers are reused for the next shards (no fresh memory
// in steady state), within the budget, and never while pinned.
func TestHotTierReusesBuffers(t *testing.T) {
	h := newHotTier(1<<20, 2, nil)
	add := func(step int64) []byte {
		t.Helper()
		m, data := shard("job", step, 0, 300_000, byte(step))
		b, ok := h.buffer(keyOf(m), m.DataSize)
		if !ok {
			t.Fatalf("step %d: no room", step)
		}
		copy(b, data)
		release, err := h.insert(m, b, hotFlags{origin: true, memory: false})
		release()
		if err != nil || b[0] != byte(step) {
			t.Fatalf("step %d not kept: %v", step, err)
		}
		checkBudget(t, h)
		return b
	}
	d1, _ := add(1), add(2)
	d3 := add(3) // step 1 goes (2 steps kept): its buffer is spare
	if &d3[0] != &d1[0] {
		t.Fatal("step 3 did not reuse step 1's buffer")
	}
	e, release := h.getAny("job", 2, 0, "a") // a restore reads step 2
	if e == nil {
		t.Fatal("step 2 not held")
	}
	d4 := add(4)
	d5 := add(5)
	if &d4[0] == &e.data[0] || &d5[0] == &e.data[0] || e.data[0] != 2 {
		t.Fatal("a pinned shard's buffer was reused")
	}
	release()
	if d6 := add(6); &d6[0] != &e.data[0] && &d6[0] != &d4[0] { // steps 2 and 4 went
		t.Fatal("step 6 took fresh memory with spares at hand")
	}
}

// A shard kept in a spare larger than it counts the spare's capacity: the
// tier never holds more than its budget while saying it is within it
// (it held up to twice its budget, counting shards by their size).
func TestHotTierCountsCapacity(t *testing.T) {
	const budget = 1 << 20
	h := newHotTier(budget, 1, nil)
	big, data := shard("job", 1, 0, 600_000, 1)
	if err := keep(h, big, data, hotFlags{origin: true}); err != nil {
		t.Fatal(err)
	}
	for step := int64(2); step < 20; step++ { // smaller shards land in the 600 kB spare, and more
		m, data := shard("job", step, 0, 300_001, byte(step))
		if err := keep(h, m, data, hotFlags{origin: true}); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		checkBudget(t, h)
	}
	if used, _, _ := h.stats(); used > budget {
		t.Fatalf("holds %d of %d", used, budget)
	}
}

// A peer's replica never replaces what the tier holds under its key: the
// sidecar's own shard (the original) stays, and a replica of the same
// save with other bytes is refused; the same bytes again are taken.
func TestReplicaNeverReplaces(t *testing.T) {
	h := newHotTier(1<<20, 2, nil)
	own, data := shard("job", 5, 0, 1000, 1)
	if err := keep(h, own, data, hotFlags{origin: true}); err != nil {
		t.Fatal(err)
	}
	forged, fdata := shard("job", 5, 0, 1000, 66)
	if err := keep(h, forged, fdata, hotFlags{memory: true}); !errors.Is(err, errHeld) {
		t.Fatalf("a replica over the original: %v", err)
	}
	if e, release := h.getAny("job", 5, 0, "a"); e == nil || e.data[0] != 1 || e.hash != own.Hash() {
		t.Fatal("the original was replaced")
	} else {
		release()
	}

	first, d1 := shard("job", 6, 1, 1000, 7)
	if err := keep(h, first, d1, hotFlags{memory: true}); err != nil {
		t.Fatal(err)
	}
	again, d2 := shard("job", 6, 1, 1000, 7)
	if err := keep(h, again, d2, hotFlags{memory: true}); err != nil {
		t.Fatalf("the same replica again: %v", err)
	}
	other, d3 := shard("job", 6, 1, 1000, 8)
	if err := keep(h, other, d3, hotFlags{memory: true}); !errors.Is(err, errHeld) {
		t.Fatalf("a replica of the same save with other content: %v", err)
	}
	if e, release := h.getAny("job", 6, 1, "a"); e == nil || e.data[0] != 7 {
		t.Fatal("the held replica was replaced")
	} else {
		release()
	}
	checkBudget(t, h)
}

// Room is made by age across jobs, never by taking another job's newest
// step: a young job (low step numbers) keeps its steps against an old one
// (it always lost, the oldest being judged by step number), and a shard
// that would need another job's newest step finds no room.
func TestEvictionByAge(t *testing.T) {
	h := newHotTier(1<<20, 4, nil)
	const n = 200_000 // five fit
	add := func(job string, step int64) error {
		m, data := shard(job, step, 0, n, byte(step))
		return keep(h, m, data, hotFlags{origin: true})
	}
	for _, s := range []struct {
		job  string
		step int64
	}{{"old", 1000}, {"young", 1}, {"old", 1001}, {"young", 2}, {"old", 1002}} {
		if err := add(s.job, s.step); err != nil {
			t.Fatal(err)
		}
	}
	if err := add("old", 1003); err != nil { // old's 1000 is the oldest kept
		t.Fatal(err)
	}
	held := func(job string, step int64) bool {
		e, release := h.getAny(job, step, 0, "a")
		if e != nil {
			release()
		}
		return e != nil
	}
	if held("old", 1000) || !held("young", 1) || !held("young", 2) {
		t.Fatal("room was not made by age")
	}
	if err := add("young", 3); err != nil { // young's 1 is the oldest now
		t.Fatal(err)
	}
	if held("young", 1) || !held("old", 1001) {
		t.Fatal("room was not made by age")
	}
	checkBudget(t, h)

	// Only each job's newest step left to take: no room.
	h2 := newHotTier(3*n, 4, nil)
	for _, job := range []string{"a", "b", "c"} {
		m, data := shard(job, 1, 0, n, 1)
		if err := keep(h2, m, data, hotFlags{origin: true}); err != nil {
			t.Fatal(err)
		}
	}
	if m, data := shard("d", 1, 0, n, 1); keep(h2, m, data, hotFlags{origin: true}) == nil {
		t.Fatal("a job's newest step was taken for another job's")
	}
}

// A shard of a step kept in memory only stays, whatever the pressure,
// until a newer step of its job is committed: then room is made of it.
func TestMemoryOnlyStepsProtected(t *testing.T) {
	const n = 200_000
	h := newHotTier(3*n, 1, nil) // --hot-steps 1 does not apply to them
	for step := int64(1); step <= 3; step++ {
		m, data := shard("job", step, 0, n, byte(step))
		if err := keep(h, m, data, hotFlags{origin: true, memory: true}); err != nil {
			t.Fatal(err)
		}
	}
	m4, d4 := shard("job", 4, 0, n, 4)
	if keep(h, m4, d4, hotFlags{origin: true, memory: true}) == nil {
		t.Fatal("a step kept in memory only was evicted")
	}
	h.committed("job", &checkpoint.CommitRecord{Version: checkpoint.CommitVersion, Job: "job", Step: 2, Attempt: "a", WorldSize: 1,
		Manifests: []checkpoint.ManifestRef{{Object: "steps/000000000002/a/rank-00000.manifest.json", Hash: "xxh3:0"}}})
	if err := keep(h, m4, d4, hotFlags{origin: true, memory: true}); err != nil {
		t.Fatalf("step 2 committed, steps 1 and 2 in memory are not protected: %v", err)
	}
	if e, release := h.getAny("job", 3, 0, "a"); e == nil {
		t.Fatal("step 3, newer than the commit, went")
	} else {
		release()
	}
	checkBudget(t, h)
}

// A tier with room for one replica takes the replica of a job's next
// step in place of the one before: the buffer to receive it into is made
// room for as an insert of that step would be (it once was asked for no
// step, and a job's only shard, its newest, was never dropped for it).
func TestReplicaOfNextStepTakesThePlace(t *testing.T) {
	tr := New(Config{HotBytes: 1 << 20})
	defer tr.Close()
	const n = 900_000
	layout, err := checkpoint.NewLayout([]checkpoint.Tensor{{Name: "w", DType: dtype.U8, Shape: []int64{n}, Length: n}})
	if err != nil {
		t.Fatal(err)
	}
	for step := int64(1); step <= 3; step++ {
		data := bytes.Repeat([]byte{byte(step)}, n)
		m := checkpoint.MemoryManifest(checkpoint.Target{Job: "job", Step: step, WorldSize: 1, Attempt: "a"}, layout, nil, data, 1<<20)
		manifest, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		b, err := tr.ReplicaBuffer(m.Target(), m.DataSize)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		copy(b, data)
		if err := tr.AcceptReplica(m.Target(), manifest, b, false); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if !tr.Holds(m.Target()) {
			t.Fatalf("step %d not held", step)
		}
	}
	checkBudget(t, tr.hot)
}

// Keep with a check keeps a drained shard only if the region still has
// the client's MACs: a region others rewrote since is not kept (and its
// buffer is given back).
func TestKeepVerifies(t *testing.T) {
	tr := New(Config{HotBytes: 1 << 20})
	defer tr.Close()
	const n = 300_000
	layout, err := checkpoint.NewLayout([]checkpoint.Tensor{{Name: "w", DType: dtype.U8, Shape: []int64{n}, Length: n}})
	if err != nil {
		t.Fatal(err)
	}
	region := bytes.Repeat([]byte{7}, n)
	m := checkpoint.MemoryManifest(checkpoint.Target{Job: "job", Step: 1, WorldSize: 1, Attempt: "a"}, layout, nil, region, 64<<10)
	check := checkpoint.NewCopyCheck([]int64{100_000, n})
	check.Hashes, err = checkpoint.Sums(check.Key, check.Ends, region)
	if err != nil {
		t.Fatal(err)
	}
	region[n-1] = 8 // rewritten after the drain
	if _, _, kept := tr.Keep(m, layout, region, check); kept || tr.Holds(m.Target()) {
		t.Fatal("a rewritten region was kept")
	}
	if _, release, kept := tr.Keep(m, layout, region, nil); !kept {
		t.Fatal("not kept unverified")
	} else {
		release()
	}
	checkBudget(t, tr.hot)
}

// In shared memory the tier's buffers are pieces of it, and room is made
// until a piece of the size is free, not only until the budget allows:
// a shard that fits the budget but no free piece drops one more shard.
func TestHotTierInSharedMemory(t *testing.T) {
	const MiB = 1 << 20
	pool, err := arena.OpenPool(t.TempDir(), 6*MiB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	h := newHotTier(6*MiB, 100, pool)
	for i, n := range []int64{2 * MiB, 2 * MiB, MiB} { // steps 1-3: pieces [0,2), [2,4), [4,5) MiB
		m, data := shard("job", int64(i+1), 0, n, byte(i+1))
		if err := keep(h, m, data, hotFlags{origin: true}); err != nil {
			t.Fatalf("step %d: %v", i+1, err)
		}
	}
	// 3 MiB: dropping step 1 makes room in the budget, but only [0,2) and
	// [5,6) are free; step 2 goes too.
	m, data := shard("job", 4, 0, 3*MiB, 4)
	if err := keep(h, m, data, hotFlags{origin: true}); err != nil {
		t.Fatal(err)
	}
	checkBudget(t, h)
	for step, want := range map[int64]bool{1: false, 2: false, 3: true, 4: true} {
		if h.holds(hotKey{"job", step, 0, "a"}) != want {
			t.Fatalf("step %d held: %v, want %v", step, !want, want)
		}
	}
	e, release := h.getAny("job", 4, 0, "a")
	defer release()
	if _, ok := pool.Offset(e.data); !ok || !bytes.Equal(e.data, data) {
		t.Fatal("step 4 is not kept in the shared memory as saved")
	}
}

// slowMemory is a pool whose Populate waits for let once it has said
// so on started, and fails without pages when fail is set.
type slowMemory struct {
	*arena.Pool
	started, let chan struct{}
	fail         bool
}

func (m *slowMemory) Populate(b []byte) error {
	close(m.started)
	<-m.let
	if m.fail {
		return errNoRoomTest
	}
	return m.Pool.Populate(b)
}

// A new piece of shared memory gets its pages outside the tier's lock:
// while it does, the tier answers lookups; a piece that gets none is
// given back, its budget with it.
func TestHotTierPopulatesOutsideItsLock(t *testing.T) {
	const MiB = 1 << 20
	for _, fail := range []bool{false, true} {
		pool, err := arena.OpenPool(t.TempDir(), 4*MiB)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pool.Close() })
		mem := &slowMemory{Pool: pool, started: make(chan struct{}), let: make(chan struct{})}
		close(mem.let)
		h := newHotTier(4*MiB, 100, mem)
		m1, d1 := shard("job", 1, 0, MiB, 1)
		if err := keep(h, m1, d1, hotFlags{origin: true}); err != nil {
			t.Fatal(err)
		}
		mem.started, mem.let, mem.fail = make(chan struct{}), make(chan struct{}), fail
		m2, d2 := shard("job", 2, 0, 2*MiB, 2)
		done := make(chan error, 1)
		go func() { done <- keep(h, m2, d2, hotFlags{origin: true}) }()
		<-mem.started
		held := make(chan bool, 1)
		go func() { held <- h.holds(hotKey{"job", 1, 0, "a"}) }()
		select {
		case ok := <-held:
			if !ok {
				t.Fatal("step 1 not held while step 2's piece is populated")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a lookup waited for a piece's pages: the tier's lock is held while populating")
		}
		close(mem.let)
		err = <-done
		if fail != (err != nil) {
			t.Fatalf("keep with a populate that fails=%v: %v", fail, err)
		}
		checkBudget(t, h)
		if held, free := h.holds(hotKey{"job", 2, 0, "a"}), pool.Fits(3*MiB); held == fail || free != fail {
			t.Fatalf("fail=%v: step 2 held %v, 3 MiB free %v", fail, held, free)
		}
	}
}
