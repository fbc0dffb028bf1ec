package prefetch

import (
	"context"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	"github.com/dgraph-io/ristretto/v2"
	"golang.org/x/sync/singleflight"

	"github.com/ckptd/ckptd/storage"
)

// Cache holds whole shards in memory within a byte budget, shared by every
// dataset iteration of the daemon. See the package comment for the policy.
type Cache struct {
	rc       *ristretto.Cache[string, []byte]
	budget   int64
	fill     singleflight.Group
	reads    atomic.Int64 // shard reads from storage, for tests and metrics
	resident atomic.Int64 // bytes admitted and not evicted
	lastUse  atomic.Int64 // unix nanoseconds of the last hit, or of the last shard admitted to free room
	// staleAfter is how long a full cache goes without a hit before it
	// admits new shards again (by evicting others).
	staleAfter time.Duration
}

// DefaultStaleAfter is how long a full cache must go without a hit before
// new shards displace the ones it holds.
const DefaultStaleAfter = time.Minute

// NewCache makes a cache of budget bytes (0 disables caching).
func NewCache(budget int64) (*Cache, error) {
	if budget < 0 {
		return nil, fmt.Errorf("%w: negative cache budget %d", ErrInvalid, budget)
	}
	c := &Cache{budget: budget, staleAfter: DefaultStaleAfter}
	gone := func(it *ristretto.Item[[]byte]) { c.resident.Add(-it.Cost) }
	counters := max(budget/(1<<20)*10, 10_000) // ~10 per expected 1 MiB+ shard
	rc, err := ristretto.NewCache(&ristretto.Config[string, []byte]{
		NumCounters: counters, MaxCost: max(budget, 1), BufferItems: 64,
		IgnoreInternalCost: true, // the budget is shard bytes
		OnEvict:            gone, OnReject: gone,
	})
	if err != nil {
		return nil, err
	}
	c.rc = rc
	c.touch()
	return c, nil
}

// admits reports whether a shard of size bytes goes into the cache: when
// there is room, or when the full cache has had no hit for staleAfter
// (what it holds is no longer read: another dataset is being read now). A full cache that is being hit keeps what it
// has. That is the policy for epoch scans of a dataset larger than the
// budget: each shard is read once per epoch, so every shard looks alike to
// a frequency sketch, and admitting each miss would evict a shard at
// random, often one about to be read; keeping a fixed subset hits a
// budget/dataset fraction of reads, the best possible.
func (c *Cache) admits(size int64) bool {
	if c.resident.Load()+size <= c.budget {
		c.touch()
		return true
	}
	return time.Since(time.Unix(0, c.lastUse.Load())) >= c.staleAfter
}

func (c *Cache) touch() { c.lastUse.Store(time.Now().UnixNano()) }

// Close releases the cache.
func (c *Cache) Close() { c.rc.Close() }

// StorageReads is how many shard reads went to storage.
func (c *Cache) StorageReads() int64 { return c.reads.Load() }

// fetch is how Get got a shard.
type fetch int

const (
	fromCache   fetch = iota
	fromStorage       // this call read it
	fromFill          // another caller was reading it; we waited
)

// Get returns a shard's bytes, from the cache or else from b under a
// per-shard lock. onMiss is called, before any storage read, when the
// shard is not cached, so the caller can account the wait to storage.
func (c *Cache) Get(ctx context.Context, b storage.Backend, sh Shard, onMiss func()) ([]byte, fetch, error) {
	// Size and time in the key: a shard rewritten in place is a new entry,
	// never the stale bytes of the old one.
	key := fmt.Sprintf("%s\x00%s\x00%d\x00%d", b.Location(), sh.Name, sh.Size, sh.ModTime.UnixNano())
	if data, ok := c.rc.Get(key); ok {
		c.touch()
		return data, fromCache, nil
	}
	onMiss()
	ran := false // set when this call, not another, reads storage
	ch := c.fill.DoChan(key, func() (any, error) {
		ran = true
		if data, ok := c.rc.Get(key); ok { // filled since our Get
			return data, nil
		}
		data, err := readShard(context.WithoutCancel(ctx), b, sh)
		if err == nil {
			c.reads.Add(1)
			c.store(key, data)
		}
		return data, err
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, fromStorage, r.Err
		}
		how := fromStorage
		if !ran {
			how = fromFill
		}
		return r.Val.([]byte), how, nil
	case <-ctx.Done():
		return nil, fromStorage, ctx.Err()
	}
}

// store caches a shard the policy admits.
func (c *Cache) store(key string, data []byte) {
	size := int64(len(data))
	if !c.admits(size) {
		return
	}
	if c.rc.Set(key, data, size) {
		c.resident.Add(size) // undone by OnReject or OnEvict
	}
	c.rc.Wait() // make it visible to the next Get
}

// readShard reads a whole shard, checking that it has the listed size.
func readShard(ctx context.Context, b storage.Backend, sh Shard) ([]byte, error) {
	rc, err := b.Get(ctx, sh.Name, 0, -1)
	if err != nil {
		return nil, fmt.Errorf("read shard %s: %w", sh.Name, err)
	}
	defer rc.Close()
	data := make([]byte, sh.Size)
	if _, err := io.ReadFull(rc, data); err != nil {
		return nil, fmt.Errorf("read shard %s: %w (expected %d bytes)", sh.Name, err, sh.Size)
	}
	return data, nil
}
