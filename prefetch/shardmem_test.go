package prefetch

import (
	"bytes"
	"context"
	"errors"
	"io"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
)

func TestSizeClass(t *testing.T) {
	const page = 4096
	for _, tc := range []struct{ n, want int64 }{
		{1, page},
		{page, page},
		{page + 1, 2 * page},
		{15 * page, 15 * page},
		{16 * page, 16 * page},
		{17 * page, 18 * page}, // five significant bits: rounded to four
		{31 * page, 32 * page},
		{32*page + 1, 36 * page},
		{16 << 20, 16 << 20},
		{16<<20 + 1, 18 << 20},
		{(16 << 20) * 33 / 32, 18 << 20},
		{1 << 40, 1 << 40},
	} {
		got := sizeClass(tc.n)
		if got != tc.want {
			t.Errorf("sizeClass(%d) = %d, want %d", tc.n, got, tc.want)
		}
		if got < tc.n || got > tc.n+tc.n/8+page {
			t.Errorf("sizeClass(%d) = %d: not within 12.5%% above", tc.n, got)
		}
	}
}

// waitFree collects garbage until the pool holds a free buffer of the
// class (cleanups run on a goroutine of their own, after a collection).
func waitFree(t *testing.T, m *shardMem, class int64) {
	t.Helper()
	collectUntil(t, "a free buffer", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return len(m.free[class]) > 0
	})
}

// collectUntil collects garbage until ok.
func collectUntil(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(testtime.Scale(10 * time.Second))
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after collections for %v", what, testtime.Scale(10*time.Second))
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
}

// setPoolAbove sets poolAbove for the test.
func setPoolAbove(t *testing.T, n int64) {
	old := poolAbove
	poolAbove = n
	t.Cleanup(func() { poolAbove = old })
}

func TestShardMemPoolsWithinItsLimit(t *testing.T) {
	const size = 1 << 20
	setPoolAbove(t, 64<<10)
	m := newShardMem(0, 2*size)
	a, b := m.buf(size), m.buf(size)
	if !a.m.borrowed() || !b.m.borrowed() || len(a.b) != size {
		t.Fatalf("under the limit: pooled %v %v, %d bytes", a.m.borrowed(), b.m.borrowed(), len(a.b))
	}
	c := m.buf(size)
	if c.m.borrowed() || len(c.b) != size {
		t.Fatalf("past the limit: pooled %v, want the heap's", c.m.borrowed())
	}
	if small := m.buf(poolAbove - 1); small.m.borrowed() {
		t.Fatal("a shard below poolAbove was pooled")
	}
	c = shardBytes{}

	first := unsafe.SliceData(a.b)
	a.b[0] = 7
	runtime.KeepAlive(a) // its bytes are the pool's while its mapping lives
	a = shardBytes{}
	waitFree(t, m, size)
	again := m.buf(size)
	if m.reused.Load() != 1 || unsafe.SliceData(again.b) != first || again.b[0] != 7 {
		t.Fatal("the buffer handed out again is not the one let go (or was zeroed)")
	}

	// The cache's heap shards count with the pool's buffers: a free buffer
	// beside one that fills the limit is unmapped.
	runtime.KeepAlive(b)
	b = shardBytes{}
	waitFree(t, m, size)
	h := heapBytes(make([]byte, size))
	m.cached(h)
	if m.heldBytes() != size {
		t.Fatalf("a cached heap shard filling the limit left %d bytes mapped, want %d", m.heldBytes(), size)
	}
	m.uncached(h)
	m.uncached(h) // once only
	if m.cachedHeap != 0 {
		t.Fatalf("%d bytes of cached heap shards after letting it go", m.cachedHeap)
	}

	// A shard no free buffer fits gets room by unmapping one.
	x := m.buf(size)
	runtime.KeepAlive(x)
	x = shardBytes{}
	waitFree(t, m, size)
	other := m.buf(400 << 10)
	if !other.m.borrowed() || m.heldBytes() != size+sizeClass(400<<10) {
		t.Fatalf("a 400 KiB shard: pooled %v, %d bytes held; want the free buffer unmapped for it", other.m.borrowed(), m.heldBytes())
	}
	runtime.KeepAlive(other)

	m.close()
	again, other = shardBytes{}, shardBytes{}
	collectUntil(t, "every buffer unmapped after close", func() bool { return m.heldBytes() == 0 })
	if got := m.buf(size); got.m.borrowed() {
		t.Fatal("a closed pool handed out a buffer")
	}
}

func (m *shardMem) heldBytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held
}

// A sample in the window that aliases a shard the cache let go gets its
// own copy; one of a shard still cached keeps aliasing it.
func TestUnaliasCopiesOnlyEvictedShards(t *testing.T) {
	gone, kept := heapBytes([]byte("evicted-shard")), heapBytes([]byte("cached-shard"))
	gone.m.evicted.Store(true)
	sh := &shuffler{window: []Sample{
		{Key: "a", Fields: []Field{{Name: "txt", Data: gone.b[:7]}}, keep: gone.m},
		{Key: "b", Fields: []Field{{Name: "txt", Data: kept.b[:6]}}, keep: kept.m},
	}}
	sh.unalias(1 << 30)
	a, b := sh.window[0], sh.window[1]
	if a.keep != nil || string(a.Fields[0].Data) != "evicted" || unsafe.SliceData(a.Fields[0].Data) == unsafe.SliceData(gone.b) {
		t.Fatalf("sample of an evicted shard: keep %v, %q, still aliasing %v",
			a.keep != nil, a.Fields[0].Data, unsafe.SliceData(a.Fields[0].Data) == unsafe.SliceData(gone.b))
	}
	if b.keep != kept.m || unsafe.SliceData(b.Fields[0].Data) != unsafe.SliceData(kept.b) {
		t.Fatal("a sample of a cached shard was copied")
	}
}

// An evicted pooled shard the window holds most of keeps being aliased,
// the largest shares first, up to the budget in bytes of buffer; the rest
// of the evicted shards' samples, and all of a heap shard's, are copied.
func TestUnaliasKeepsTheShardsTheWindowHoldsMostOf(t *testing.T) {
	pooled := func(evicted bool) *mapping {
		buf := bytes.Repeat([]byte("x"), 1000)
		m := &mapping{data: buf, slot: &memSlot{buf: buf}}
		m.evicted.Store(evicted)
		return m
	}
	most, half, little, cached := pooled(true), pooled(true), pooled(true), pooled(false)
	heap := heapBytes(bytes.Repeat([]byte("h"), 1000)).m
	heap.evicted.Store(true)
	sample := func(m *mapping, n int) Sample {
		return Sample{Key: "k", Fields: []Field{{Name: "bin", Data: m.data[:n]}}, keep: m}
	}
	of := []*mapping{most, little, half, heap, cached} // the window's samples' shards, in order
	sizes := []int{900, 100, 500, 900, 10}
	for _, tc := range []struct {
		budget  int64
		aliased []*mapping // besides cached
	}{
		{budget: 2000, aliased: []*mapping{most, half}},
		{budget: 1999, aliased: []*mapping{most}},
		{budget: 1 << 30, aliased: []*mapping{most, half, little}},
		{budget: 0},
	} {
		sh := &shuffler{}
		for i, m := range of {
			sh.window = append(sh.window, sample(m, sizes[i]))
		}
		if kept, want := sh.unalias(tc.budget), int64(1000*len(tc.aliased)); kept != want {
			t.Errorf("budget %d: unalias kept %d bytes, want %d", tc.budget, kept, want)
		}
		for i, x := range sh.window {
			m := of[i]
			want := m == cached || slices.Contains(tc.aliased, m)
			same := unsafe.SliceData(x.Fields[0].Data) == unsafe.SliceData(m.data)
			if same != want || (x.keep != nil) != want || !bytes.Equal(x.Fields[0].Data, m.data[:len(x.Fields[0].Data)]) {
				t.Errorf("budget %d: a sample of %d bytes aliasing %v, keeping %v; want %v",
					tc.budget, len(x.Fields[0].Data), same, x.keep != nil, want)
			}
		}
	}
}

// The windows of all sessions keep at most the pool's keep room of
// evicted buffers: a session is left what the others do not keep.
func TestKeepBudgetIsSharedBySessions(t *testing.T) {
	m := newShardMem(1<<30, 3000)
	for _, tc := range []struct{ all, mine, want int64 }{
		{0, 0, 3000},
		{2000, 500, 1500},
		{3000, 0, 0},
		{3500, 0, 0}, // sessions updating at once may overshoot a little
		{3000, 3000, 3000},
	} {
		m.kept.Store(tc.all)
		if got := m.keepBudget(tc.mine); got != tc.want {
			t.Errorf("%d kept in all, %d of them mine: budget %d, want %d", tc.all, tc.mine, got, tc.want)
		}
	}
}

// checkedEpoch reads an epoch of a makeTar dataset, checking that every
// sample holds its own bytes, and calling between each batch; it returns
// the samples read.
func checkedEpoch(t *testing.T, b storage.Backend, prefix string, c *Cache, spec Spec, payload int, between func()) int {
	t.Helper()
	ctx := context.Background()
	it, err := Open(ctx, b, prefix, c, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	n := 0
	for {
		batch, err := it.Next(ctx)
		if errors.Is(err, io.EOF) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, smp := range batch.Samples {
			want := bytes.Repeat([]byte(smp.Key), payload/len(smp.Key)+1)[:payload]
			if !bytes.Equal(smp.Fields[1].Data, want) {
				t.Fatalf("epoch %d: sample %s holds another's bytes", spec.Epoch, smp.Key)
			}
		}
		n += len(batch.Samples)
		between()
	}
}

// Shards read from a store into pooled memory come back to the pool once
// the cache evicted them and the windows copied their samples out, and
// hold other shards then; every sample keeps its own shard's bytes, with
// collections run as often as the pool could take buffers back.
func TestPooledShardMemoryIsUsedAgain(t *testing.T) {
	setPoolAbove(t, 4096)
	const shards, per, payload = 12, 8, 8000
	b := dataset(t, shards, per, payload)
	c := newCache(t, 3*per*payload)
	for epoch := range 3 {
		spec := Spec{BatchSize: 4, WorldSize: 1, Seed: 1, Epoch: int64(epoch), ShuffleWindow: 12}
		if n := checkedEpoch(t, b, "train/", c, spec, payload, runtime.GC); n != shards*per {
			t.Fatalf("epoch %d: %d samples, want %d", epoch, n, shards*per)
		}
		if n := c.mem.kept.Load(); n != 0 {
			t.Fatalf("epoch %d over: %d bytes still counted as kept by its window", epoch, n)
		}
	}
	if c.evictions.Load() == 0 || c.mem.reused.Load() == 0 {
		t.Fatalf("%d shards evicted, %d buffers used again; want both", c.evictions.Load(), c.mem.reused.Load())
	}
}

func (m *shardMem) state() (held, carved, ready int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held, m.carved, m.ready
}

// Memory taken ahead is carved into the first shards' buffers; past it
// the pool maps buffers as before; a free buffer up to twice as large
// serves a smaller shard; close gives all of it back.
func TestShardMemTakesAhead(t *testing.T) {
	const mib = 1 << 20
	setPoolAbove(t, 64<<10)
	m := newShardMem(0, 16*mib)
	var told atomic.Int64 // what the daemon is told it holds off the heap
	m.onHeld = func(n int64) { told.Store(n) }
	got, err := m.takeAhead(4*mib+100, make(chan struct{}))
	if err != nil || got != 4*mib || told.Load() != 4*mib {
		t.Fatalf("takeAhead: %d bytes, %v, %d reported; want %d", got, err, told.Load(), 4*mib)
	}
	var bufs []shardBytes
	for i := range 4 {
		b := m.buf(mib)
		if b.m.slot == nil || !b.m.slot.carved {
			t.Fatalf("shard %d: not carved from the memory taken ahead", i)
		}
		bufs = append(bufs, b)
	}
	own := m.buf(mib)
	if own.m.slot == nil || own.m.slot.carved {
		t.Fatal("past the memory taken ahead: want a buffer of its own")
	}
	if held, carved, ready := m.state(); held != 5*mib || carved != 4*mib || ready != 4*mib || told.Load() != held {
		t.Fatalf("held %d (%d reported), carved %d, ready %d", held, told.Load(), carved, ready)
	}

	first := unsafe.SliceData(bufs[0].b)
	bufs[0].b[0] = 9
	runtime.KeepAlive(bufs[0])
	bufs[0] = shardBytes{}
	waitFree(t, m, mib)
	again := m.buf(mib)
	if unsafe.SliceData(again.b) != first || !again.m.slot.carved || again.b[0] != 9 {
		t.Fatal("the carved buffer let go was not handed out again")
	}

	bufs[1] = shardBytes{}
	waitFree(t, m, mib)
	smaller := m.buf(700 << 10)
	if len(smaller.b) != 700<<10 || len(smaller.m.slot.buf) != mib || smaller.cost() != mib {
		t.Fatalf("a shard of 700 KiB got a buffer of %d, cost %d; want the free 1 MiB one", len(smaller.m.slot.buf), smaller.cost())
	}
	runtime.KeepAlive(own)

	m.close()
	bufs, own, again, smaller = nil, shardBytes{}, shardBytes{}, shardBytes{}
	collectUntil(t, "every buffer unmapped after close", func() bool { return m.heldBytes() == 0 && told.Load() == 0 })
}

// takeAhead stops at once when told to, and close then gives back what
// it mapped; the shards read meanwhile are the heap's or their own.
func TestShardMemTakeAheadStops(t *testing.T) {
	m := newShardMem(0, 256<<20)
	stop := make(chan struct{})
	close(stop)
	got, err := m.takeAhead(256<<20, stop)
	if err != nil || got != 0 {
		t.Fatalf("takeAhead, stopped: %d bytes, %v; want 0", got, err)
	}
	if b := m.buf(1 << 20); b.m.slot == nil || b.m.slot.carved {
		t.Fatal("carved from memory whose pages were not taken")
	}
	m.close()
	if held, _, _ := m.state(); held != 1<<20 { // the buffer above, until collected
		t.Fatalf("after close: %d bytes held, want the one buffer handed out", held)
	}
}

// takingEpoch starts a service allowed an S3 source, which takes
// cacheBytes and room beyond at start, calls before, and reads an epoch
// checking every sample's bytes.
func takingEpoch(t *testing.T, cacheBytes int64, before func(*Service)) *Service {
	t.Helper()
	setPoolAbove(t, 4096)
	const shards, per, payload = 4, 10, 1000
	b := posixDataset(t, shards, per, payload)
	cfg := ServiceConfig{CacheBytes: cacheBytes, CacheAtStart: true, Options: Options{ReadAheadBytes: 8 << 20}}
	s := newService(t, b, cfg)
	before(s)
	if n := checkedEpoch(t, b, "", s.cache, Spec{BatchSize: 8, WorldSize: 1}, payload, func() {}); n != shards*per {
		t.Fatalf("%d samples, want %d", n, shards*per)
	}
	return s
}

// A service allowed an S3 source takes its cache's memory at start, and
// the shards then read from the source land in it.
func TestServiceTakesCacheMemoryForS3(t *testing.T) {
	want := int64(4<<20 + shardMemSlack) // the cache, and room beyond it (at least 64 MiB)
	s := takingEpoch(t, 4<<20, func(s *Service) {
		if s.cache.mem.limit != want {
			t.Fatalf("shard memory limit %d, want %d", s.cache.mem.limit, want)
		}
		waitFor(t, "shard memory taken", func() bool { _, _, ready := s.cache.mem.state(); return ready == want })
	})
	if _, carved, _ := s.cache.mem.state(); carved == 0 {
		t.Fatal("no shard read into the memory taken")
	}
}

// The first iteration stops the take at start: taking more would only
// compete with its reads. What was taken stays, and the epoch reads as
// it would have.
func TestFirstIterationStopsTheTake(t *testing.T) {
	// 8 GiB of address space: populated 64 MiB at a time, it cannot
	// all be taken before the iteration opens.
	s := takingEpoch(t, 8<<30, func(*Service) {})
	s.cache.taking.Wait()
	if held, _, ready := s.cache.mem.state(); ready >= s.cache.mem.limit || held >= s.cache.mem.limit/2 {
		t.Fatalf("%d of %d bytes taken, %d held: want the take stopped", ready, s.cache.mem.limit, held)
	}
}

func TestMemoryTakenAtStartOnlyForACacheOfS3(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  ServiceConfig
		want bool
	}{
		{"a cache and an S3 source", ServiceConfig{CacheAtStart: true, CacheBytes: 1 << 30, Allow: []string{"/data", "s3://b/p"}}, true},
		{"turned off", ServiceConfig{CacheAtStart: false, CacheBytes: 1 << 30, Allow: []string{"s3://b"}}, false},
		{"no cache", ServiceConfig{CacheAtStart: true, CacheBytes: 0, Allow: []string{"s3://b"}}, false},
		{"folders only: mapped", ServiceConfig{CacheAtStart: true, CacheBytes: 1 << 30, Allow: []string{"/data"}}, false},
		{"datasets off", ServiceConfig{CacheAtStart: true, CacheBytes: 1 << 30, Allow: []string{"s3://b"}, Off: true}, false},
	} {
		allow, err := newAllowList(tc.cfg.Allow, nil)
		if err != nil {
			t.Fatal(err)
		}
		if got := tc.cfg.takesMemoryAtStart(allow); got != tc.want {
			t.Errorf("%s: takes memory at start %v, want %v", tc.name, got, tc.want)
		}
	}
}
