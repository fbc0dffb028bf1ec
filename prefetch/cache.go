package prefetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dgraph-io/ristretto/v2"
	"github.com/dgraph-io/ristretto/v2/z"

	"github.com/ckptd/ckptd/storage"
)

// Cache holds whole shards in memory within a byte budget, shared by every
// dataset iteration of the daemon. See the package comment for the policy;
// admission implements it.
type Cache struct {
	rc      *ristretto.Cache[string, shardBytes]
	adm     *admission
	ahead   *lookahead
	storeMu sync.Mutex
	reads   atomic.Int64 // shard reads from storage, for tests and metrics

	mu    sync.Mutex
	fills map[string]*fill // shards being read, by key

	counts  *sampleCounts // shards' sample counts, for even epochs
	footers *footerCache  // Parquet files' footers, for listings
	// disk is the disk tier of remote sources' shards (nil: none);
	// diskHits counts the shards it served.
	disk     *diskCache
	diskHits atomic.Int64
	// mem is the memory of shards read into memory (see shardMem);
	// evictions counts those the cache let go (letGo).
	mem       *shardMem
	evictions atomic.Int64
	// takeStop stops takeMemory's goroutine, which taking is: closed
	// once (endTake) by the first iteration or by Close.
	takeStop chan struct{}
	takeEnd  sync.Once
	taking   sync.WaitGroup

	// Get holds life shared and Close whole, so that the ristretto cache is
	// closed after every Get and every fill is over (a fill outlives the
	// Gets that left it, until its read returns).
	life    sync.RWMutex
	closed  bool // under life
	running sync.WaitGroup
}

// fill is one read of a shard from storage, shared by the callers that
// want the shard meanwhile, and cancelled when none of them does any more
// (so that iterations that stop leave no reads behind).
type fill struct {
	done    chan struct{}
	data    shardBytes
	held    bool // stored in the cache
	err     error
	waiters int
	cancel  context.CancelFunc
}

// DefaultStaleAfter is how long a dataset folder's cached shards must go
// unread before the shards of another may displace them.
const DefaultStaleAfter = time.Minute

// NewCache makes a cache of budget bytes (0 disables caching).
func NewCache(budget int64) (*Cache, error) {
	if budget < 0 {
		return nil, fmt.Errorf("%w: negative cache budget %d", ErrInvalid, budget)
	}
	c := &Cache{adm: newAdmission(budget, DefaultStaleAfter), ahead: newLookahead(), fills: map[string]*fill{}, counts: newSampleCounts(CountBytes), footers: newFooterCache(FooterBytes), takeStop: make(chan struct{})}
	c.mem = newShardMem(budget, shardMemSlack)
	gone := func(it *ristretto.Item[shardBytes]) {
		c.adm.release(it.Key, it.Conflict)
		c.letGo(it.Value)
	}
	counters := max(budget/(1<<20)*10, 10_000) // ~10 per expected 1 MiB+ shard
	rc, err := ristretto.NewCache(&ristretto.Config[string, shardBytes]{
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

// Close cancels the reads under way, waits for them and for every Get,
// and releases the cache; a Get after it is ErrClosed.
func (c *Cache) Close() {
	c.mu.Lock()
	for _, f := range c.fills {
		f.cancel()
	}
	c.mu.Unlock()
	c.life.Lock()
	closed := c.closed
	c.closed = true
	c.life.Unlock()
	if closed {
		return
	}
	c.running.Wait()
	c.rc.Close()
	c.endTake()
	c.taking.Wait()
	c.mem.close()
}

// takeMemory takes the shard buffers' whole limit of memory now,
// in the background (shardMem.takeAhead): the pages a first epoch from a
// remote source would take as its shards come, taken while the trainer
// is still starting. The first iteration stops it (endTake): from then
// on it would only compete with the reads for the CPU, and with a cache
// larger than the dataset take memory the epoch never needs. It logs
// how it ended.
func (c *Cache) takeMemory(log *slog.Logger) {
	n := c.mem.limit
	c.taking.Go(func() {
		start := time.Now()
		got, err := c.mem.takeAhead(n, c.takeStop)
		switch {
		case err != nil:
			log.Warn("dataset shard memory: could not take all of it; the rest comes as shards do",
				"bytes", got, "wanted", n, "err", err)
		case got < n:
			log.Info("dataset shard memory: stopped taking it (a dataset was opened, or the daemon is stopping); the rest comes as shards do",
				"bytes", got, "wanted", n, "seconds", time.Since(start).Seconds())
		default:
			log.Info("dataset shard memory taken", "bytes", got, "seconds", time.Since(start).Seconds())
		}
	})
}

// endTake stops takeMemory, keeping what it took.
func (c *Cache) endTake() { c.takeEnd.Do(func() { close(c.takeStop) }) }

// StorageReads is how many shard reads went to storage.
func (c *Cache) StorageReads() int64 { return c.reads.Load() }

// fetch is how Get got a shard.
type fetch int

const (
	fromCache   fetch = iota
	fromStorage       // this call read it
	fromFill          // another caller was reading it; we waited
)

// get returns a shard's bytes, from the cache or else from b, read once
// for all the callers that want it at the same time. held says whether
// the cache keeps the bytes (else they are the caller's alone). dataset
// (the source's prefix in b) groups the shards admission ages together.
// onMiss is called, before any storage read, when the shard is not cached,
// so the caller can account the wait to storage. at is the read of an
// iteration's plan this is (readAt{}: none).
func (c *Cache) get(ctx context.Context, b storage.Backend, dataset string, sh Shard, at readAt, onMiss func()) (data shardBytes, held bool, how fetch, err error) {
	c.life.RLock()
	defer c.life.RUnlock()
	if c.closed {
		return shardBytes{}, false, fromStorage, ErrClosed
	}
	key := shardKey(b, sh)
	group := groupOf(b, dataset)
	if data, ok := c.rc.Get(key); ok {
		c.adm.used(group)
		c.ahead.lookedUp(at)
		return data, true, fromCache, nil
	}
	c.ahead.lookedUp(at)
	onMiss()
	c.mu.Lock()
	f, how := c.fills[key], fromFill
	if f == nil {
		fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		f, how = &fill{done: make(chan struct{}), cancel: cancel}, fromStorage
		c.fills[key] = f
		c.running.Add(1)
		go func() {
			defer c.running.Done()
			c.fill(fctx, f, key, group, b, sh, at)
		}()
	}
	f.waiters++
	c.mu.Unlock()
	select {
	case <-f.done:
		c.leave(key, f)
		return f.data, f.held, how, f.err
	case <-ctx.Done():
		c.leave(key, f)
		return shardBytes{}, false, how, ctx.Err()
	}
}

// fill reads a shard and caches it if admission lets it.
func (c *Cache) fill(ctx context.Context, f *fill, key, group string, b storage.Backend, sh Shard, at readAt) {
	defer f.cancel()
	var later func()                   // the disk tier's write, once the readers have the shard
	if data, ok := c.rc.Get(key); ok { // filled since the caller looked
		f.data, f.held = data, true
	} else if f.data, later, f.err = c.read(ctx, b, sh, key, at); f.err == nil {
		f.held = c.store(key, group, f.data, at)
	}
	c.mu.Lock()
	if c.fills[key] == f {
		delete(c.fills, key)
	}
	c.mu.Unlock()
	close(f.done)
	if later != nil && f.err == nil {
		later()
	}
}

// leave ends a caller's wait on f; the last to leave a read still running
// cancels it, and a later caller starts another.
func (c *Cache) leave(key string, f *fill) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.waiters--; f.waiters > 0 {
		return
	}
	select {
	case <-f.done:
	default:
		f.cancel()
		if c.fills[key] == f {
			delete(c.fills, key)
		}
	}
}

func groupOf(b storage.Backend, dataset string) string { return b.Location() + "\x00" + dataset }

// shardKey is a shard's cache key. Size and time are in it: a shard
// rewritten in place is a new entry, never the stale bytes of the old one.
func shardKey(b storage.Backend, sh Shard) string {
	return fmt.Sprintf("%s\x00%s\x00%d\x00%d", b.Location(), sh.Name, sh.Size, sh.ModTime.UnixNano())
}

// plan registers the shards an iteration will read, in order (see
// lookahead); Get is told readAt{p, i} for its i-th read, and done says
// it ended.
func (c *Cache) plan(shards []Shard) (p *plan, done func()) {
	keys := make([]string, len(shards))
	type id struct {
		src  *shardSource
		name string
	}
	known := map[id]string{} // one key string per shard, however many epochs ahead
	for i, sh := range shards {
		k, ok := known[id{sh.src, sh.Name}]
		if !ok {
			k = shardKey(sh.src.b, sh)
			known[id{sh.src, sh.Name}] = k
		}
		keys[i] = k
	}
	p = c.ahead.register(keys)
	var once sync.Once
	return p, func() { once.Do(func() { c.ahead.remove(p) }) }
}

// passed says an iteration's read will never ask the cache (a streamed
// shard), so that the lookahead's present moves past it.
func (c *Cache) passed(at readAt) { c.ahead.lookedUp(at) }

// pin keeps the cached shards of the dataset under prefix in b from being
// evicted (as stale) until the returned function is called: an iteration's
// samples may alias them.
func (c *Cache) pin(b storage.Backend, prefix string) func() {
	g := groupOf(b, prefix)
	c.adm.pin(g)
	var once sync.Once
	return func() { once.Do(func() { c.adm.unpin(g) }) }
}

// store caches a shard the policy admits, and reports whether it did.
// Stores run one at a time, so that one's Set never reaches ristretto
// before another's Dels have made the room admission counted on
// (ristretto would then evict on its own).
func (c *Cache) store(key, group string, data shardBytes, at readAt) bool {
	c.storeMu.Lock()
	defer c.storeMu.Unlock()
	next, mine := c.ahead.distances(at, key)
	evict, ok := c.adm.reserve(key, group, data.cost(), next, mine)
	if !ok {
		return false
	}
	for _, k := range evict {
		c.drop(k)
	}
	if !c.rc.Set(key, data, data.cost()) {
		h, conflict := z.KeyToHash(key)
		c.adm.release(h, conflict) // dropped by a full buffer
		return false
	}
	c.mem.cached(data)
	c.rc.Wait() // make it visible to the next Get
	return true
}

// shardBytes is a shard read whole: its bytes, and the mapping they lie
// in (see mapping), which whatever keeps the bytes keeps too. Code that
// reads b must keep the shardBytes (or m) alive until it is done: when
// the mapping is unreachable, a file is unmapped and a pooled buffer is
// handed to another shard, and the compiler may find it unreachable
// before the last use of b (runtime.KeepAlive).
type shardBytes struct {
	b []byte
	m *mapping
}

// cost is what the shard's bytes take in memory, which the cache's budget
// counts: a pooled buffer's whole size class.
func (d shardBytes) cost() int64 {
	if d.m != nil && d.m.slot != nil {
		return int64(len(d.m.slot.buf))
	}
	return int64(len(d.b))
}

// forget drops a shard from the cache and from admission's books (its
// file changed under a mapping), under storeMu like the evictions store
// makes.
func (c *Cache) forget(b storage.Backend, sh Shard) {
	key := shardKey(b, sh)
	c.storeMu.Lock()
	defer c.storeMu.Unlock()
	h, conflict := z.KeyToHash(key)
	c.adm.release(h, conflict)
	c.drop(key)
	c.rc.Wait()
}

// drop deletes a shard from the ristretto cache, whose Del calls no
// OnEvict, and lets its memory go.
func (c *Cache) drop(key string) {
	if data, ok := c.rc.Get(key); ok {
		c.letGo(data)
	}
	c.rc.Del(key)
}

// letGo marks a shard's memory as no longer the cache's: the iterations
// whose samples alias it copy them out (assembler.unalias), so that it
// is freed or goes back to the pool.
func (c *Cache) letGo(data shardBytes) {
	c.mem.uncached(data)
	if m := data.m; m != nil && !m.file && !m.evicted.Swap(true) {
		c.evictions.Add(1)
	}
}

// localOf finds a local source's backend beneath the decorators around
// it (ServiceConfig.WrapSource), which pass on Unwrap.
func localOf(b storage.Backend) (*localBackend, bool) {
	for {
		if lb, ok := b.(*localBackend); ok {
			return lb, true
		}
		u, ok := b.(interface{ Unwrap() storage.Backend })
		if !ok {
			return nil, false
		}
		b = u.Unwrap()
	}
}

// read reads a whole shard for the cache (key) and decodes it: from the
// disk tier when it holds a remote source's shard, else from storage,
// giving the disk tier what storage gave.
// It returns the disk tier's write to run once the shard's readers have
// it, if any.
func (c *Cache) read(ctx context.Context, b storage.Backend, sh Shard, key string, at readAt) (shardBytes, func(), error) {
	if _, local := localOf(b); c.disk == nil || local {
		data, err := readShard(ctx, b, sh, c.mem)
		if err == nil {
			c.reads.Add(1)
		}
		return data, nil, err
	}
	var write func()
	stored, ok := c.disk.load(key, sh.Size)
	if ok {
		c.diskHit()
	} else {
		var err error
		if stored, err = readStored(ctx, b, sh, c.mem); err != nil {
			return shardBytes{}, nil, err
		}
		c.reads.Add(1)
		next, mine := c.ahead.distances(at, key)
		if w := c.disk.store(key, stored.b, next, mine); w != nil {
			write = func() {
				w()
				runtime.KeepAlive(stored.m) // pooled bytes stay ours until written
			}
		}
	}
	data, err := decodeShard(sh, stored)
	return data, write, err
}

// stream opens a shard to be streamed (parsed as it is read, never held
// whole): from the disk tier when it holds a remote source's shard, else
// from storage, the bytes then written to the disk tier as they pass.
// The caller calls done once it stops reading, ok when it parsed the
// shard to its end without error: the rest is read through and the
// disk's copy put in place (else dropped).
func (c *Cache) stream(ctx context.Context, sh Shard) (r io.ReadCloser, done func(ok bool)) {
	b := sh.src.b
	rr := &rangeReader{ctx: ctx, b: b, name: sh.objectName(), size: sh.Size}
	if _, local := localOf(b); c.disk == nil || local || sh.objectName() != sh.Name {
		return rr, func(bool) {}
	}
	key := shardKey(b, sh)
	if f, ok := c.disk.open(key, sh.Size); ok {
		c.diskHit()
		return f, func(bool) {}
	}
	name, f := c.disk.reserve(key, sh.Size, nil, 0)
	if f == nil {
		return rr, func(bool) {}
	}
	w, err := c.disk.create(name, f)
	if err != nil {
		w.abort(err)
		return rr, func(bool) {}
	}
	tee := &teeCloser{Reader: io.TeeReader(rr, w), c: rr} // w never fails a read: see diskWriter.Write
	return tee, func(ok bool) {
		if ok {
			_, err := io.Copy(io.Discard, tee) // what the parser left: padding, an end marker
			if err == nil {
				err = w.commit()
			}
			if err == nil {
				return
			}
			w.abort(err)
			return
		}
		w.abort(nil)
	}
}

// teeCloser is a reader teed into the disk tier, closing its source.
type teeCloser struct {
	io.Reader
	c io.Closer
}

func (t *teeCloser) Close() error { return t.c.Close() }

// DiskHits is how many shards the disk tier served.
func (c *Cache) DiskHits() int64 { return c.diskHits.Load() }

// diskHit counts a shard the disk tier served, here and in the metrics.
func (c *Cache) diskHit() {
	c.diskHits.Add(1)
	if c.disk.hit != nil {
		c.disk.hit()
	}
}

// readShard reads a whole shard and decodes it (decodeShard).
func readShard(ctx context.Context, b storage.Backend, sh Shard, mem *shardMem) (shardBytes, error) {
	data, err := readStored(ctx, b, sh, mem)
	if err != nil {
		return shardBytes{}, err
	}
	return decodeShard(sh, data)
}

// readStored reads a shard's stored bytes, checking that it has the listed
// size: a local source's larger shards are mapped instead (see mapAbove),
// or read when mapping fails. A part of an object (a Parquet row group) is
// a ranged read. The bytes are mem's (nil: the Go heap's).
func readStored(ctx context.Context, b storage.Backend, sh Shard, mem *shardMem) (shardBytes, error) {
	if sh.objectName() != sh.Name {
		return readRange(ctx, b, sh, mem)
	}
	if lb, ok := localOf(b); ok && sh.Size > mapAbove {
		m, err := lb.mapShard(ctx, sh.Name, sh.Size)
		if err == nil {
			return shardBytes{b: m.data, m: m}, nil
		}
		if errors.Is(err, ErrCorruptShard) || errors.Is(err, storage.ErrNotFound) || errors.Is(err, ErrNotAllowed) || ctx.Err() != nil {
			return shardBytes{}, fmt.Errorf("read shard %s: %w", printable(sh.Name), err)
		}
		// Out of mappings (vm.max_map_count) or address space: read it.
	}
	rc, err := b.Get(ctx, sh.Name, 0, -1)
	if err != nil {
		return shardBytes{}, fmt.Errorf("read shard %s: %w", printable(sh.Name), err)
	}
	defer rc.Close()
	data := mem.buf(sh.Size)
	if _, err := io.ReadFull(rc, data.b); err != nil {
		return shardBytes{}, fmt.Errorf("read shard %s: %w (expected %d bytes)", printable(sh.Name), err, sh.Size)
	}
	return data, nil
}

// readRange reads the Size bytes of a shard that is a part of an object.
func readRange(ctx context.Context, b storage.Backend, sh Shard, mem *shardMem) (shardBytes, error) {
	rc, err := b.Get(ctx, sh.objectName(), sh.offset(), sh.Size)
	if err != nil {
		return shardBytes{}, fmt.Errorf("read shard %s: %w", printable(sh.Name), err)
	}
	defer rc.Close()
	data := mem.buf(sh.Size)
	if _, err := io.ReadFull(rc, data.b); err != nil {
		return shardBytes{}, fmt.Errorf("read shard %s: %w (expected %d bytes at %d of %s)",
			printable(sh.Name), err, sh.Size, sh.offset(), printable(sh.objectName()))
	}
	return data, nil
}
