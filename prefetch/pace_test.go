package prefetch

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

func TestPacerTarget(t *testing.T) {
	const MiB = 1 << 20
	for _, tc := range []struct {
		name     string
		shards   int           // consumed, each 16 MiB
		interval time.Duration // between them
		fetch    time.Duration // each read from storage (0: none, all cached)
		want     int64
	}{
		{"nothing measured yet", 0, 0, 0, 256 * MiB},
		{"warming up", paceWarmup - 1, 100 * time.Millisecond, 50 * time.Millisecond, 256 * MiB},
		{"every shard cached", 10, 100 * time.Millisecond, 0, 256 * MiB},
		// 160 MB/s consumed, 50 ms a read: 2 × 8 MiB in flight, plus a shard.
		{"slow consumer", 10, 100 * time.Millisecond, 50 * time.Millisecond, 32 * MiB},
		{"very slow consumer: two shards", 10, 10 * time.Second, 50 * time.Millisecond, 32 * MiB},
		// 1.6 GB/s, 100 ms a read: 2 × 160 MiB + 16 MiB, above the ceiling.
		{"fast consumer: the whole budget", 10, 10 * time.Millisecond, 100 * time.Millisecond, 256 * MiB},
		// 320 MB/s, 100 ms a read: 2 × 32 MiB + 16 MiB.
		{"between", 10, 50 * time.Millisecond, 100 * time.Millisecond, 80 * MiB},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPacer(256 * MiB)
			now := time.Unix(0, 0)
			p.now = func() time.Time { return now }
			for range tc.shards {
				now = now.Add(tc.interval)
				p.consumedShard(16 * MiB)
				if tc.fetch > 0 {
					p.fetched(tc.fetch)
				}
			}
			if got := p.target(); got != tc.want {
				t.Fatalf("target %d MiB; want %d MiB", got/MiB, tc.want/MiB)
			}
		})
	}
}

// A shard larger than the target is still read when nothing is held; a
// wait ends when a consumed shard makes room.
func TestPacerWait(t *testing.T) {
	p := newPacer(100)
	ctx := context.Background()
	if err := p.wait(ctx, 1000, func() int64 { return 0 }); err != nil {
		t.Fatalf("a shard above the target with nothing held: %v", err)
	}
	var held atomic.Int64
	held.Store(60)
	done := make(chan error, 1)
	go func() { done <- p.wait(ctx, 50, held.Load) }()
	select {
	case err := <-done:
		t.Fatalf("60 + 50 bytes within a target of 100: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	held.Store(40) // the consumer finished a shard
	p.consumedShard(20)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := p.wait(cctx, 100, func() int64 { return 60 }); err == nil {
		t.Fatal("a cancelled wait returned nil")
	}
}

// A consumer much slower than storage holds a couple of shards ahead, not
// the whole read-ahead budget; it still gets every sample.
func TestSlowConsumerHoldsLittleAhead(t *testing.T) {
	const shards = 40
	b := dataset(t, shards, 8, 8000)
	size := shardSize(t, b)
	opts := Options{ReadAheadBytes: 4 * 16 * size, MaxReads: 16} // 16 shards ahead at most
	it, err := Open(context.Background(), b, "train/", newCache(t, 0), Spec{BatchSize: 8, WorldSize: 1, ShuffleWindow: 1}, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var n int
	var peak int64
	for {
		batch, err := it.Next(context.Background())
		if err != nil {
			break
		}
		n += len(batch.Samples)
		if n > 8*20 { // past the warm-up, and the 16 shards it read ahead then
			peak = max(peak, it.shardsMem.used.Load())
		}
		time.Sleep(30 * time.Millisecond)
	}
	if n != shards*8 {
		t.Fatalf("%d samples; want %d", n, shards*8)
	}
	if peak > 6*size {
		t.Fatalf("a consumer taking a shard per 30 ms held %d shards ahead of %d allowed; want the pacer's few", peak/size, 16)
	}
	t.Logf("held at most %d shards ahead after the warm-up (budget %d)", peak/size, 16)
}
