package prefetch

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Options bound an iteration's memory and read-ahead.
type Options struct {
	// ReadAheadBytes bounds every byte the iteration holds (default 256
	// MiB): shards read ahead, samples in the shuffle window, batches
	// being assembled; see the package comment.
	ReadAheadBytes int64
	// MaxReads bounds concurrent shard reads (default 4).
	MaxReads int
	// BatchesAhead is how many batches are assembled before the consumer
	// asks (default 2).
	BatchesAhead int
	// ListBytes bounds what the dataset's listing costs the iteration
	// (default 128 MiB: about 200,000 shards of 60-byte names); see
	// ListShards.
	ListBytes int64
}

// DefaultReadAheadBytes is Options.ReadAheadBytes' default.
const DefaultReadAheadBytes = 256 << 20

// DefaultListBytes is Options.ListBytes' default.
const DefaultListBytes = 128 << 20

// minReadAhead keeps the halves of the read-ahead budget useful.
const minReadAhead = 1 << 20

func (o *Options) setDefaults() {
	if o.ReadAheadBytes <= 0 {
		o.ReadAheadBytes = DefaultReadAheadBytes
	}
	o.ReadAheadBytes = max(o.ReadAheadBytes, minReadAhead)
	if o.MaxReads <= 0 {
		o.MaxReads = 4
	}
	if o.BatchesAhead <= 0 {
		o.BatchesAhead = 2
	}
	if o.ListBytes <= 0 {
		o.ListBytes = DefaultListBytes
	}
}

// The read-ahead budget's parts: half bounds the shuffle window (with the
// sample being read), a quarter the batches being assembled and waiting
// for the consumer, a quarter the shards read ahead whole, each at most
// half of that, so that two fit at once. A larger shard is streamed:
// parsed as it is read, never held whole.
func (o *Options) window() int64      { return o.ReadAheadBytes / 2 }
func (o *Options) batches() int64     { return o.ReadAheadBytes / 4 }
func (o *Options) samples() int64     { return o.window() + o.batches() }
func (o *Options) readAhead() int64   { return o.ReadAheadBytes - o.samples() }
func (o *Options) streamAbove() int64 { return o.readAhead() / 2 }

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
	WaitStorage time.Duration // waiting on a shard read from storage
	WaitCache   time.Duration // waiting on a shard another rank was reading
	WaitWork    time.Duration // waiting while shards were parsed and batched
	WaitRing    time.Duration // (daemon) waiting while the consumer held every ring slot
	CacheHits   int64
	CacheMisses int64
	// CorruptSkipped counts, with skip_corrupt, the shards cut short by
	// damage (their samples before it were delivered) and the samples
	// skipped for a name that cannot be delivered or a size beyond the
	// read-ahead budget.
	CorruptSkipped int64
	// Padded counts the samples delivered again to pad the rank's epoch to
	// the others' count (EvenPad).
	Padded int64
	Shards int // shards this rank reads this epoch
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
	closed  sync.Once
	unpin   func()
	plan    *plan // the cache's lookahead over this iteration's reads
	cache   *Cache
	unplan  func()
	last    *Batch // the batch Next returned last, released by the next call
	// The halves of the read-ahead budget: shards read ahead, samples.
	shardsMem, samplesMem *meter
	pace                  *pacer // how much of shardsMem to use
	// even, for an even epoch of several ranks: how many samples each
	// delivers; left is the epoch's shard order, which padding reads from.
	even *evenTarget
	left []Shard

	mu    sync.Mutex
	stats Stats
	// What Delivered answers from: the batches Next returned, not yet
	// folded into delivered, and each shard's sample count once parsed.
	log       []batchIDs
	delivered *Delivered
	folded    int64 // the position delivered is at
	totals    map[string]int
}

// batchIDs are the samples of a batch Next returned, by shard and place.
type batchIDs struct {
	position int64
	shards   []string
	ords     []int
}

type result struct {
	batch *Batch
	err   error
}

// pendingShard is a shard being fetched (or, when stream is set, to be
// streamed by the assembler); done is closed when data or err is set.
type pendingShard struct {
	shard   Shard
	stream  bool
	data    shardBytes
	held    bool // data is the cache's
	how     fetch
	err     error
	miss    atomic.Bool
	release func() // returns its part of the read-ahead budget once parsed
	done    chan struct{}
}

// Open starts one rank's iteration over one epoch of the dataset under
// prefix in b.
func Open(ctx context.Context, b storage.Backend, prefix string, cache *Cache, spec Spec, opts Options) (*Iterator, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	opts.setDefaults()
	all, format, err := listDataset(ctx, b, prefix, spec.Format, opts.ListBytes, cache)
	if err != nil {
		return nil, err
	}
	spec.Format = format
	src := &shardSource{b: b, prefix: prefix, format: format}
	for i := range all {
		all[i].src = src
	}
	order := func(epoch int64, delivered *Delivered) []Shard { return epochOrder(all, spec.Seed, epoch, delivered) }
	return start(ctx, []*shardSource{src}, order, cache, spec, opts)
}

// shardSource is where an iteration's shard comes from: its source's
// backend, prefix and format (a mixture reads several).
type shardSource struct {
	b      storage.Backend
	prefix string
	format Format
	// keyPrefix comes before the keys of its samples: in a mixture, the
	// source's place and "/", so that keys stay apart.
	keyPrefix string
}

// epochFunc is a dataset's shard order of an epoch, without the shards
// delivered holds whole.
type epochFunc func(epoch int64, delivered *Delivered) []Shard

// start starts an iteration over the shards order gives, every one of
// them from one of srcs.
func start(ctx context.Context, srcs []*shardSource, order epochFunc, cache *Cache, spec Spec, opts Options) (*Iterator, error) {
	left := order(spec.Epoch, spec.Delivered)
	if spec.Even == EvenDrop && spec.WorldSize > len(left) && spec.Delivered == nil {
		return nil, fmt.Errorf("%w: even drop: %d shards for %d ranks: a rank without a shard delivers nothing, so every rank would; "+
			"give the dataset at least as many shards as ranks (DataLoader workers multiply them), or pad", ErrInvalid, len(left), spec.WorldSize)
	}
	mine := deal(left, spec.Rank, spec.WorldSize)
	cache.endTake() // its shards are read from now on
	plan, unplan := cache.plan(future(order, mine, spec))
	var unpins []func()
	for _, src := range srcs {
		unpins = append(unpins, cache.pin(src.b, src.prefix)) // samples may alias the dataset's cached shards
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	it := &Iterator{
		spec: spec, batches: make(chan result, opts.BatchesAhead),
		cancel: cancel, done: make(chan struct{}),
		unpin: func() {
			for _, u := range unpins {
				u()
			}
		},
		unplan: unplan, plan: plan, cache: cache,
		shardsMem: newMeter(opts.readAhead()), samplesMem: newMeter(opts.samples()),
		pace: newPacer(opts.readAhead()),
	}
	it.stats.Shards = len(mine)
	if spec.Even != EvenOff && spec.WorldSize > 1 {
		it.even = newEvenTarget(ctx, spec.Even, cache, left, spec.WorldSize, spec.Delivered)
		it.left = left
	}
	it.delivered, it.totals, it.folded = NewDelivered(), map[string]int{}, spec.Start
	if spec.Delivered != nil {
		it.delivered = spec.Delivered.Clone()
	}
	queue := make(chan *pendingShard, opts.MaxReads)
	go it.fetchAll(ctx, cache, mine, opts, queue)
	go func() {
		defer close(it.done)
		it.assemble(ctx, queue, opts)
	}()
	return it, nil
}

// The cache's lookahead knows the rest of an iteration's epoch and the
// rank's next planEpochs epochs, at most maxPlanReads reads in all. (Two
// epochs ahead reach the offline optimum's storage reads in the tests,
// where one left a node of a two-node job 5-15% above it: a shard no
// read of the next epoch wants may be wanted soon after.)
const (
	planEpochs   = 2
	maxPlanReads = 1 << 20
)

// future is the reads the cache looks ahead at: mine, then the rank's
// next epochs' shards.
func future(order epochFunc, mine []Shard, spec Spec) []Shard {
	out := slices.Clone(mine)
	for e := int64(1); e <= planEpochs && len(out) < maxPlanReads && spec.Epoch <= math.MaxInt64-e; e++ {
		out = append(out, deal(order(spec.Epoch+e, nil), spec.Rank, spec.WorldSize)...)
	}
	return out[:min(len(out), maxPlanReads)]
}

// Close stops the iteration and waits for its goroutines.
func (it *Iterator) Close() {
	it.closed.Do(func() {
		it.cancel()
		<-it.done
		for r := range it.batches {
			if r.batch != nil {
				r.batch.Release()
			}
		}
		it.unpin()
		it.unplan()
	})
}

// Next returns the next batch, or io.EOF at the end of the epoch. It
// releases the batch it returned before.
func (it *Iterator) Next(ctx context.Context) (*Batch, error) {
	if it.last != nil {
		it.last.Release()
		it.last = nil
	}
	start, state := time.Now(), it.state.Load()
	select {
	case r, ok := <-it.batches:
		it.account(state, time.Since(start))
		if !ok {
			return nil, io.EOF
		}
		it.last = r.batch
		if r.batch != nil {
			it.logBatch(r.batch)
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

func (it *Iterator) count(f func(*Stats)) {
	it.mu.Lock()
	defer it.mu.Unlock()
	f(&it.stats)
}

// fetchAll reads shards ahead, in order, bounded by bytes in flight (the
// pacer's target within the budget) and (through queue's capacity) by
// concurrent reads, and queues them for assemble, which returns each
// shard's weight when done with it. Shards larger than streamAbove are
// queued to be streamed, not read. It closes queue.
func (it *Iterator) fetchAll(ctx context.Context, cache *Cache, shards []Shard, opts Options, queue chan<- *pendingShard) {
	defer close(queue)
	budget := it.shardsMem
	for i, sh := range shards {
		p := &pendingShard{shard: sh, done: make(chan struct{}), release: func() {}}
		stream, err := streamed(sh, opts)
		if err != nil {
			p.err, p.how = err, fromStorage
			cache.passed(readAt{it.plan, i})
			close(p.done)
		} else if stream {
			p.stream, p.how = true, fromStorage
			cache.passed(readAt{it.plan, i}) // streamed: the cache never serves it
			close(p.done)
		} else {
			w := sh.weight()
			if err := it.pace.wait(ctx, w, budget.used.Load); err != nil {
				return
			}
			if err := budget.Acquire(ctx, w); err != nil {
				return
			}
			p.release = func() {
				budget.Release(w)
				it.pace.consumedShard(w)
			}
			go func() {
				defer close(p.done)
				start := time.Now()
				p.data, p.held, p.how, p.err = cache.get(ctx, sh.src.b, sh.src.prefix, sh, readAt{it.plan, i}, func() { p.miss.Store(true) })
				if p.how != fromCache && p.err == nil {
					it.pace.fetched(time.Since(start))
				}
			}()
		}
		select {
		case queue <- p:
		case <-ctx.Done():
			return
		}
	}
}

// maxLogged bounds the batches logBatch keeps by sample: the consumer's
// position trails the batches handed out by the ring and its own prefetch,
// a few batches; older ones are folded into the delivered bitmaps, so a
// session nobody asks for its position holds a bit per sample, not a log.
const maxLogged = 64

// logBatch remembers which samples a batch handed out, for Delivered.
func (it *Iterator) logBatch(b *Batch) {
	ids := batchIDs{position: b.Position, shards: make([]string, len(b.Samples)), ords: make([]int, len(b.Samples))}
	for i, s := range b.Samples {
		ids.shards[i], ids.ords[i] = s.shard, s.ord
		if s.pad {
			ids.ords[i] = -1 // a repeat: delivered by the rank whose shard it is
		}
	}
	it.mu.Lock()
	defer it.mu.Unlock()
	it.log = append(it.log, ids)
	if n := len(it.log) - maxLogged; n > 0 {
		it.fold(n)
	}
}

// fold moves the first n logged batches into delivered. Call with mu.
func (it *Iterator) fold(n int) {
	for _, b := range it.log[:n] {
		for i, shard := range b.shards {
			if b.ords[i] >= 0 {
				it.delivered.add(shard, b.ords[i])
			}
		}
		it.folded = b.position
	}
	it.log = slices.Delete(it.log, 0, n)
}

// batchDelivered is the samples of b (padding left out) as an encoded
// position, with the sample counts of their shards known by now.
func (it *Iterator) batchDelivered(b *Batch) []byte {
	d := NewDelivered()
	for _, s := range b.Samples {
		if !s.pad {
			d.add(s.shard, s.ord)
		}
	}
	it.mu.Lock()
	for shard := range d.shards {
		if total, ok := it.totals[shard]; ok {
			d.setTotal(shard, total)
		}
	}
	it.mu.Unlock()
	return d.Encode()
}

// skipped records a sample delivered before the iteration resumed from
// Spec.Start: part of what Delivered answers.
func (it *Iterator) skipped(shard string, ord int) {
	it.mu.Lock()
	defer it.mu.Unlock()
	it.delivered.add(shard, ord)
}

// shardTotal records how many samples a shard parsed whole has.
func (it *Iterator) shardTotal(shard string, n int) {
	it.mu.Lock()
	defer it.mu.Unlock()
	it.totals[shard] = n
}

// Delivered returns the samples of the epoch delivered once the consumer
// has position samples (a Batch.Position it was handed, or the position it
// resumed from): with the set the iteration resumed from, if any. Positions
// only move forward: one before the last asked for is refused.
func (it *Iterator) Delivered(position int64) (*Delivered, error) {
	it.mu.Lock()
	defer it.mu.Unlock()
	if position < it.folded {
		return nil, fmt.Errorf("%w: position %d is before %d, asked for already or more than %d batches behind",
			ErrInvalid, position, it.folded, maxLogged)
	}
	n := 0
	for n < len(it.log) && it.log[n].position <= position {
		n++
	}
	if position != it.folded && (n == 0 || it.log[n-1].position != position) {
		return nil, fmt.Errorf("%w: position %d is not where a batch handed out ends", ErrInvalid, position)
	}
	it.fold(n)
	it.folded = position
	for shard, total := range it.totals {
		if _, ok := it.delivered.shards[shard]; ok {
			it.delivered.setTotal(shard, total)
		}
	}
	return it.delivered.Clone(), nil
}
