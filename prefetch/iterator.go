package prefetch

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/ckptd/ckptd/storage"
)

// Options bound an iteration's read-ahead.
type Options struct {
	// ReadAheadBytes bounds the shard bytes fetched but not yet batched
	// (default 256 MiB); a shard larger than it is read alone.
	ReadAheadBytes int64
	// MaxReads bounds concurrent shard reads (default 4).
	MaxReads int
	// BatchesAhead is how many batches are assembled before the consumer
	// asks (default 2).
	BatchesAhead int
}

func (o *Options) setDefaults() {
	if o.ReadAheadBytes <= 0 {
		o.ReadAheadBytes = 256 << 20
	}
	if o.MaxReads <= 0 {
		o.MaxReads = 4
	}
	if o.BatchesAhead <= 0 {
		o.BatchesAhead = 2
	}
}

// Batch is the next batch_size samples of the rank's sequence (fewer at
// the end of the epoch).
type Batch struct {
	Samples []Sample
	// Position is the samples this rank has consumed in the epoch once it
	// has this batch: the start to resume from.
	Position int64
	release  func()
}

// Release gives the batch's memory back to the iteration's read-ahead
// budget; its samples must not be used after. Next releases the previous
// batch if its caller has not.
func (b *Batch) Release() {
	if b.release != nil {
		b.release()
		b.release = nil
	}
}

// Stats account where the consumer's waiting went, and the cache's work.
type Stats struct {
	WaitStorage    time.Duration // waiting on a shard read from storage
	WaitCache      time.Duration // waiting on a shard another rank was reading
	WaitWork       time.Duration // waiting while shards were parsed and batched
	WaitRing       time.Duration // (daemon) waiting while the consumer held every ring slot
	CacheHits      int64
	CacheMisses    int64
	CorruptSkipped int64
	Shards         int // shards this rank reads this epoch
}

// Cause is why a consumer waited for a batch.
type Cause int32

// The causes of waiting. CauseRing is the daemon's: every ring slot was
// held by the consumer.
const (
	CauseWork    Cause = iota // parsing, batching, copying
	CauseStorage              // a shard read from storage (a cache miss)
	CauseCache                // a shard another rank was reading into the cache
	CauseRing
)

func (c Cause) String() string {
	return [...]string{"work", "storage", "cache", "ring"}[c]
}

// The producer's states are the causes it can be waiting on.
const (
	stateWork    = int32(CauseWork)
	stateStorage = int32(CauseStorage)
	stateCache   = int32(CauseCache)
)

// Iterator delivers one rank's batches for one epoch. Next and Stats may
// be called from one goroutine at a time; Close from any.
type Iterator struct {
	spec    Spec
	batches chan result
	state   atomic.Int32
	cancel  context.CancelFunc
	done    chan struct{}

	mu    sync.Mutex
	stats Stats
}

type result struct {
	batch *Batch
	err   error
}

// pendingShard is a shard being fetched; done is closed when data or err
// is set.
type pendingShard struct {
	shard   Shard
	data    []byte
	how     fetch
	err     error
	miss    atomic.Bool
	release func() // returns the shard's read-ahead budget
	done    chan struct{}
}

// Open starts one rank's iteration over one epoch of the dataset under
// prefix in b.
func Open(ctx context.Context, b storage.Backend, prefix string, cache *Cache, spec Spec, opts Options) (*Iterator, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	opts.setDefaults()
	all, err := ListShards(ctx, b, prefix, spec.Format)
	if err != nil {
		return nil, err
	}
	mine := ShardsForRank(all, spec.Seed, spec.Epoch, spec.Rank, spec.WorldSize)
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	it := &Iterator{
		spec: spec, batches: make(chan result, opts.BatchesAhead),
		cancel: cancel, done: make(chan struct{}),
	}
	it.stats.Shards = len(mine)
	queue := make(chan *pendingShard, opts.MaxReads)
	go it.fetchAll(ctx, b, prefix, cache, mine, opts, queue)
	go func() {
		defer close(it.done)
		it.assemble(ctx, prefix, queue, opts)
	}()
	return it, nil
}

// Close stops the iteration and waits for its goroutines.
func (it *Iterator) Close() {
	it.cancel()
	<-it.done
}

// Next returns the next batch, or io.EOF at the end of the epoch.
func (it *Iterator) Next(ctx context.Context) (*Batch, error) {
	start, state := time.Now(), it.state.Load()
	select {
	case r, ok := <-it.batches:
		it.account(state, time.Since(start))
		if !ok {
			return nil, io.EOF
		}
		return r.batch, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (it *Iterator) account(state int32, d time.Duration) {
	it.mu.Lock()
	defer it.mu.Unlock()
	switch state {
	case stateStorage:
		it.stats.WaitStorage += d
	case stateCache:
		it.stats.WaitCache += d
	default:
		it.stats.WaitWork += d
	}
}

// Waiting says what the iteration is waiting on now: CauseStorage,
// CauseCache, or CauseWork (parsing and batching, or nothing).
func (it *Iterator) Waiting() Cause { return Cause(it.state.Load()) }

// Stats returns the iteration's accounting so far.
func (it *Iterator) Stats() Stats {
	it.mu.Lock()
	defer it.mu.Unlock()
	return it.stats
}

// fetchAll reads shards ahead, in order, bounded by bytes in flight and
// (through queue's capacity) by concurrent reads, and queues them for
// assemble, which returns each shard's weight when done with it. It closes
// queue.
func (it *Iterator) fetchAll(ctx context.Context, b storage.Backend, prefix string, cache *Cache, shards []Shard, opts Options, queue chan<- *pendingShard) {
	defer close(queue)
	budget := semaphore.NewWeighted(opts.ReadAheadBytes)
	for _, sh := range shards {
		weight := min(max(sh.Size, 1), opts.ReadAheadBytes)
		if err := budget.Acquire(ctx, weight); err != nil {
			return
		}
		p := &pendingShard{shard: sh, done: make(chan struct{}), release: func() { budget.Release(weight) }}
		select {
		case queue <- p:
		case <-ctx.Done():
			return
		}
		go func() {
			defer close(p.done)
			p.data, p.how, p.err = cache.Get(ctx, b, prefix, sh, func() { p.miss.Store(true) })
		}()
	}
}

// assemble turns fetched shards into samples, shuffles them, drops the
// first spec.Start, and sends batches. It closes it.batches.
func (it *Iterator) assemble(ctx context.Context, prefix string, queue <-chan *pendingShard, opts Options) {
	defer close(it.batches)
	a := &assembler{it: it, ctx: ctx, shuf: newShuffler(&it.spec)}
	for p := range queue {
		err := a.shard(p, prefix)
		p.release()
		if err != nil {
			a.send(result{err: err})
			return
		}
	}
	for _, s := range a.shuf.flush() {
		if !a.emit(s) {
			return
		}
	}
	if len(a.batch) > 0 {
		a.send(result{batch: &Batch{Samples: a.batch, Position: a.pos}})
	}
}

type assembler struct {
	it    *Iterator
	ctx   context.Context
	shuf  *shuffler
	seen  int64 // samples out of the shuffler, skipped ones included
	pos   int64
	batch []Sample
}

// shard waits for one fetched shard and feeds its samples through.
func (a *assembler) shard(p *pendingShard, prefix string) error {
	a.it.state.Store(stateCache)
	if p.miss.Load() {
		a.it.state.Store(stateStorage)
	}
	select {
	case <-p.done:
	case <-a.ctx.Done():
		return a.ctx.Err()
	}
	a.it.state.Store(stateWork)
	if p.err != nil {
		return p.err
	}
	a.it.countFetch(p.how)
	samples, err := parseShard(a.it.spec.Format, p.shard, prefix, p.data)
	if errors.Is(err, ErrCorruptShard) && a.it.spec.SkipCorrupt {
		a.it.mu.Lock()
		a.it.stats.CorruptSkipped++
		a.it.mu.Unlock()
		return nil
	}
	if err != nil {
		return err
	}
	for _, s := range samples {
		if out, ok := a.shuf.push(s); ok && !a.emit(out) {
			return a.ctx.Err()
		}
	}
	return nil
}

// emit skips the samples before spec.Start and batches the rest.
func (a *assembler) emit(s Sample) bool {
	a.seen++
	if a.seen <= a.it.spec.Start {
		return true
	}
	a.batch = append(a.batch, s)
	a.pos = a.seen
	if len(a.batch) < a.it.spec.BatchSize {
		return true
	}
	ok := a.send(result{batch: &Batch{Samples: a.batch, Position: a.pos}})
	a.batch = nil
	return ok
}

func (a *assembler) send(r result) bool {
	select {
	case a.it.batches <- r:
		return true
	case <-a.ctx.Done():
		return false
	}
}

func (it *Iterator) countFetch(how fetch) {
	it.mu.Lock()
	defer it.mu.Unlock()
	if how == fromCache {
		it.stats.CacheHits++
	} else {
		it.stats.CacheMisses++
	}
}
