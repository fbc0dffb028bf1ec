package prefetch

import (
	"bytes"
	"context"
	"errors"
	"io"
	"runtime"
	"testing"
	"time"
	"unsafe"
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

// waitReused collects garbage until the pool has handed out a buffer
// again (cleanups run on a goroutine of their own, after a collection).
func waitReused(t *testing.T, m *shardMem, size, want int64) shardBytes {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		got := m.buf(size)
		if m.reused.Load() >= want {
			return got
		}
		got = shardBytes{}
		if time.Now().After(deadline) {
			t.Fatalf("no buffer came back: %d reused, want %d", m.reused.Load(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestShardMemPoolsWithinItsLimit(t *testing.T) {
	const size = 1 << 20
	m := newShardMem(2 * size)
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
	first := unsafe.SliceData(a.b)
	a.b[0] = 7
	a, c = shardBytes{}, shardBytes{}
	again := waitReused(t, m, size, 1)
	if unsafe.SliceData(again.b) != first || again.b[0] != 7 {
		t.Fatal("the buffer handed out again is not the one let go (or was zeroed)")
	}
	runtime.KeepAlive(b)

	m.close()
	b, again = shardBytes{}, shardBytes{}
	deadline := time.Now().Add(10 * time.Second)
	for m.heldBytes() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after close: %d bytes still mapped", m.heldBytes())
		}
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
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
	sh.unalias()
	a, b := sh.window[0], sh.window[1]
	if a.keep != nil || string(a.Fields[0].Data) != "evicted" || unsafe.SliceData(a.Fields[0].Data) == unsafe.SliceData(gone.b) {
		t.Fatalf("sample of an evicted shard: keep %v, %q, still aliasing %v",
			a.keep != nil, a.Fields[0].Data, unsafe.SliceData(a.Fields[0].Data) == unsafe.SliceData(gone.b))
	}
	if b.keep != kept.m || unsafe.SliceData(b.Fields[0].Data) != unsafe.SliceData(kept.b) {
		t.Fatal("a sample of a cached shard was copied")
	}
}

// Shards read from a store into pooled memory come back to the pool once
// the cache evicted them and the windows copied their samples out, and
// hold other shards then; every sample keeps its own shard's bytes, with
// collections run as often as the pool could take buffers back.
func TestPooledShardMemoryIsUsedAgain(t *testing.T) {
	old := poolAbove
	poolAbove = 4096
	t.Cleanup(func() { poolAbove = old })
	const shards, per, payload = 12, 8, 8000
	b := dataset(t, shards, per, payload)
	c := newCache(t, 3*per*payload)
	ctx := context.Background()
	for epoch := range 3 {
		it, err := Open(ctx, b, "train/", c, Spec{BatchSize: 4, WorldSize: 1, Seed: 1, Epoch: int64(epoch), ShuffleWindow: 12}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for {
			batch, err := it.Next(ctx)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range batch.Samples {
				want := bytes.Repeat([]byte(s.Key), payload/len(s.Key)+1)[:payload]
				if !bytes.Equal(s.Fields[1].Data, want) {
					t.Fatalf("epoch %d: sample %s holds another's bytes", epoch, s.Key)
				}
			}
			n += len(batch.Samples)
			runtime.GC()
		}
		it.Close()
		if n != shards*per {
			t.Fatalf("epoch %d: %d samples, want %d", epoch, n, shards*per)
		}
	}
	if c.evictions.Load() == 0 || c.mem.reused.Load() == 0 {
		t.Fatalf("%d shards evicted, %d buffers used again; want both", c.evictions.Load(), c.mem.reused.Load())
	}
}
