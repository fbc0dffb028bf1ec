package prefetch

import (
	"context"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/dgraph-io/ristretto/v2/z"
	"golang.org/x/sync/singleflight"

	"github.com/ckptd/ckptd/storage"
)

// Cache holds whole shards in memory within a byte budget, shared by every
// dataset iteration of the daemon. See the package comment for the policy;
// admission implements it.
type Cache struct {
	rc      *ristretto.Cache[string, []byte]
	adm     *admission
	storeMu sync.Mutex
	fill    singleflight.Group
	reads   atomic.Int64 // shard reads from storage, for tests and metrics
}

// DefaultStaleAfter is how long a dataset folder's cached shards must go
// unread before the shards of another may displace them.
const DefaultStaleAfter = time.Minute

// NewCache makes a cache of budget bytes (0 disables caching).
func NewCache(budget int64) (*Cache, error) {
	if budget < 0 {
		return nil, fmt.Errorf("%w: negative cache budget %d", ErrInvalid, budget)
	}
	c := &Cache{adm: newAdmission(budget, DefaultStaleAfter)}
	gone := func(it *ristretto.Item[[]byte]) { c.adm.release(it.Key, it.Conflict) }
	counters := max(budget/(1<<20)*10, 10_000) // ~10 per expected 1 MiB+ shard
	rc, err := ristretto.NewCache(&ristretto.Config[string, []byte]{
		NumCounters: counters, MaxCost: max(budget, 1), BufferItems: 64,
		IgnoreInternalCost: true, // the budget is shard bytes, as admission counts them
		KeyToHash:          z.KeyToHash[string],
		OnEvict:            gone, OnReject: gone,
	})
	if err != nil {
		return nil, err
	}
	c.rc = rc
	return c, nil
}

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
// per-shard lock. dataset (the source's prefix in b) groups the shards
// admission ages together. onMiss is called, before any storage read, when
// the shard is not cached, so the caller can account the wait to storage.
func (c *Cache) Get(ctx context.Context, b storage.Backend, dataset string, sh Shard, onMiss func()) ([]byte, fetch, error) {
	// Size and time in the key: a shard rewritten in place is a new entry,
	// never the stale bytes of the old one.
	key := fmt.Sprintf("%s\x00%s\x00%d\x00%d", b.Location(), sh.Name, sh.Size, sh.ModTime.UnixNano())
	group := b.Location() + "\x00" + dataset
	if data, ok := c.rc.Get(key); ok {
		c.adm.used(group)
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
			c.store(key, group, data)
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

// store caches a shard the policy admits. Stores run one at a time, so
// that one's Set never reaches ristretto before another's Dels have made
// the room admission counted on (ristretto would then evict on its own).
func (c *Cache) store(key, group string, data []byte) {
	c.storeMu.Lock()
	defer c.storeMu.Unlock()
	evict, ok := c.adm.reserve(key, group, int64(len(data)))
	if !ok {
		return
	}
	for _, k := range evict {
		c.rc.Del(k)
	}
	if !c.rc.Set(key, data, int64(len(data))) {
		h, conflict := z.KeyToHash(key)
		c.adm.release(h, conflict) // dropped by a full buffer
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
