package prefetch

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

// ErrTooLarge: a sample, or a batch of them, is larger than the part of
// the read-ahead budget samples may take; the daemon answers
// RESOURCE_EXHAUSTED. The message names --read-ahead-bytes.
var ErrTooLarge = errors.New("larger than the dataset read-ahead budget")

// assemble turns fetched shards into samples, shuffles them, drops the
// first spec.Start, and sends batches. It closes it.batches.
func (it *Iterator) assemble(ctx context.Context, queue <-chan *pendingShard, opts Options) {
	defer close(it.batches)
	a := &assembler{
		it: it, ctx: ctx, spec: &it.spec, shuf: newShuffler(&it.spec), opts: opts,
		mem: it.samplesMem, window: opts.window(), batchLimit: opts.batches(),
	}
	defer a.dropKept()
	for p := range queue {
		err := a.shard(p)
		p.release()
		if err == nil {
			err = a.emitAll(a.shuf.endShard())
		}
		if errors.Is(err, errEnough) {
			a.last()
			return
		}
		if err != nil {
			a.send(result{err: err})
			return
		}
	}
	if ctx.Err() != nil {
		return
	}
	if err := a.finish(); err != nil && !errors.Is(err, errEnough) {
		a.send(result{err: err})
	} else if err != nil {
		a.last()
	}
}

// last sends the batch being assembled, short, when the rank's even share
// ends the epoch early.
func (a *assembler) last() {
	if len(a.batch) > 0 {
		if err := a.sendBatch(); err != nil && a.ctx.Err() == nil {
			a.send(result{err: err})
		}
	}
}

// assembler cuts shards into samples member by member, and accounts every
// sample it holds (the one being read, those in the shuffle window, those
// of the batch being assembled, and batches sent but not released) to mem,
// which the samples' part of the read-ahead budget sizes.
//
// The window is bounded by bytes as well as by count, deterministically:
// before a member is read, samples leave the window (chosen by the same
// generator as always) until the window and the sample being read, with
// the member, fit in window bytes. The order therefore depends only on
// the samples' sizes and the budget, never on timing, nor on where an
// iteration resumes; with samples small enough that the window never
// reaches its bound, it is the plain count-bounded window's. A batch
// larger than batchLimit is an error (deterministic too); batches sent
// wait for their charge to come back when mem is full, which only the
// consumer's progress can make.
type assembler struct {
	it         *Iterator
	ctx        context.Context
	spec       *Spec
	opts       Options
	shuf       *shuffler
	mem        *meter
	window     int64 // bound on inWindow
	batchLimit int64 // bound on batchCost
	inWindow   int64 // bytes of the window and of cur

	cur  *Sample  // the sample being read: a run of members sharing a key
	keep *mapping // the mapped shard the samples being read alias, if any
	bad  string   // why cur cannot be delivered ("" when it can)
	ord  int      // samples begun in the current shard
	seen int64    // samples out of the shuffler, skipped ones included
	pos  int64

	batch     []Sample
	batchCost int64
	batchMeta int64

	padding bool  // reading shards again to pad the epoch (EvenPad)
	swept   int64 // the cache's evictions when the window was last unaliased
	aliased bool  // the window may alias shards the cache let go
	kept    int64 // bytes of such shards' buffers it kept then (shardMem.kept)
}

// unalias copies out, once per shard read and only after the cache
// evicted something or while evicted shards are kept aliased, the bytes
// of the window's samples whose shard it evicted (see mapping): all but
// those of the pooled buffers it holds most of, up to the window's bound
// in bytes of them, within what the pool leaves for all sessions'.
func (a *assembler) unalias() {
	if n := a.it.cache.evictions.Load(); n != a.swept || a.aliased {
		a.swept = n
		mem := a.it.cache.mem
		kept := a.shuf.unalias(min(a.window, mem.keepBudget(a.kept)))
		mem.kept.Add(kept - a.kept)
		a.kept, a.aliased = kept, kept > 0
	}
}

// dropKept gives back the session's share of the pool's kept bytes: its
// window is dropped with the iteration.
func (a *assembler) dropKept() {
	a.it.cache.mem.kept.Add(-a.kept)
	a.kept = 0
}

// shard waits for one fetched shard (or opens one to stream) and feeds
// its samples through. A shard whose bytes are damaged delivers the
// samples before the damage; then it fails the epoch, or with
// skip_corrupt is counted and left.
func (a *assembler) shard(p *pendingShard) error {
	src := p.shard.src
	a.it.state.Store(stateCache)
	if p.miss.Load() || p.stream {
		a.it.state.Store(stateStorage)
	}
	select {
	case <-p.done:
	case <-a.ctx.Done():
		return a.ctx.Err()
	}
	var se *ShardError
	switch {
	case p.err == nil:
	case errors.As(p.err, &se) && a.spec.SkipCorrupt:
		a.it.count(func(st *Stats) { st.CorruptSkipped++ }) // damaged as a whole (a hash, a decompression)
		return nil
	default:
		return p.err
	}
	a.it.countFetch(p.how)
	a.unalias()
	a.ord = 0
	var err error
	if p.stream {
		err = a.stream(p.shard)
	} else {
		a.it.state.Store(stateWork)
		if err = a.whole(p); errors.Is(err, ErrShardChanged) {
			a.it.cache.forget(src.b, p.shard) // so that the next read maps it again
		}
	}
	a.it.state.Store(stateWork)
	if err == nil {
		a.it.shardTotal(p.shard.ID(), a.ord)
		a.it.cache.counts.learn(src.b, p.shard, a.ord) // what countSamples would say: counted for free
		return a.endSample()
	}
	a.dropSample()
	var re readError
	switch {
	case errors.As(err, &re), a.ctx.Err() != nil, errors.Is(err, ErrTooLarge), errors.Is(err, ErrCorruptShard), errors.Is(err, errEnough):
		return err
	case a.spec.SkipCorrupt:
		a.it.count(func(st *Stats) { st.CorruptSkipped++ })
		return nil
	}
	return corrupt(p.shard, "%v", err)
}

// whole parses a shard read whole. Samples alias the bytes the cache
// holds, and pooled buffers (see unalias); of a shard it does not, they
// are copied out, so that no sample keeps a whole shard alive.
func (a *assembler) whole(p *pendingShard) error {
	if p.data.m == nil {
		return a.walk(p)
	}
	if p.aliased() {
		if !p.held {
			// A pooled buffer the cache did not take is as good as
			// evicted: the window copies its samples out as it would
			// an evicted shard's (unalias), not all of them at once.
			p.data.m.evicted.Store(true)
			a.aliased = true
		}
		a.keep = p.data.m // samples alias the mapped shard: they keep the mapping
		defer func() { a.keep = nil }()
	}
	return readMapped(func() error { return a.walk(p) })
}

// aliased says whether the samples cut from the shard may alias its
// bytes: those of the cache (kept while it holds them, see unalias), or
// a pooled buffer's. Others are copied out, so that none keeps a whole
// shard alive.
func (p *pendingShard) aliased() bool {
	return p.held || p.data.m != nil && p.data.m.slot != nil
}

// walk cuts the samples out of a shard read whole.
func (a *assembler) walk(p *pendingShard) error {
	data, src := p.data.b, p.shard.src
	own := func(field []byte) []byte {
		if p.aliased() {
			return field
		}
		return bytes.Clone(field)
	}
	switch u := p.shard.unit; {
	case src.format == Raw:
		key, ext := rawKey(p.shard.Name, src.prefix)
		return a.member(p.shard, p.shard.Name, key, ext, int64(len(data)), func() ([]byte, error) {
			// The object is the sample: our buffer, or the cache's
			// bytes (a mapping the sample keeps). A file mapping the
			// cache does not hold is copied: nothing would keep it mapped.
			if p.data.m.borrowed() && !p.aliased() {
				return bytes.Clone(data), nil
			}
			return data, nil
		})
	case u != nil && u.mds != nil:
		br := bytes.NewReader(data)
		pos := func() int64 { return int64(len(data)) - int64(br.Len()) }
		return a.mdsSamples(p.shard, br, pos, int64(len(data)), func(f mdsField) func() ([]byte, error) {
			return func() ([]byte, error) { return own(data[f.start : f.start+f.size : f.start+f.size]), nil }
		})
	case u != nil && u.pq != nil:
		return a.pqSamples(p.shard, data)
	}
	br := bytes.NewReader(data)
	pos := func() int64 { return int64(len(data)) - int64(br.Len()) }
	return walkTar(br, pos, int64(len(data)), func(m member) error {
		key, ext := splitKey(m.name)
		return a.member(p.shard, m.name, key, ext, m.size, func() ([]byte, error) {
			return own(data[m.start : m.start+m.size : m.start+m.size]), nil
		})
	})
}

// streamBuffer is the read buffer of a streamed shard.
const streamBuffer = 256 << 10

// stream parses a shard as it reads it (archive/tar over a ranged read),
// holding no more of it than the sample being read.
func (a *assembler) stream(sh Shard) (err error) {
	r, done := a.it.cache.stream(a.ctx, sh)
	defer r.Close()
	defer func() { done(err == nil) }()
	read := func(n int64, from io.Reader) func() ([]byte, error) {
		return func() ([]byte, error) {
			buf := make([]byte, n)
			_, err := io.ReadFull(from, buf)
			return buf, err
		}
	}
	if sh.src.format == Raw {
		key, ext := rawKey(sh.Name, sh.src.prefix)
		return a.member(sh, sh.Name, key, ext, sh.Size, read(sh.Size, r))
	}
	if sh.unit != nil && sh.unit.mds != nil {
		return a.streamMDS(sh, r, read)
	}
	c := &counter{r: bufio.NewReaderSize(r, streamBuffer)}
	return walkTar(c, func() int64 { return c.n }, sh.Size, func(m member) error {
		key, ext := splitKey(m.name)
		return a.member(sh, m.name, key, ext, m.size, read(m.size, m.r))
	})
}

// member adds one member (one field) to the sample being read, or starts
// the next sample. get returns the member's bytes; it is called once they
// are charged.
func (a *assembler) member(sh Shard, name, key, ext string, size int64, get func() ([]byte, error)) error {
	if sh.src != nil {
		key = sh.src.keyPrefix + key
	}
	if a.cur != nil && key != a.cur.Key {
		if err := a.endSample(); err != nil {
			return err
		}
	}
	cost := size + int64(len(ext)) + fieldOverhead
	if a.cur == nil {
		a.cur = &Sample{Key: strings.Clone(key), shard: sh.ID(), ord: a.ord, keep: a.keep}
		a.cur.skip = !a.padding && a.spec.Delivered != nil && a.spec.Delivered.Has(sh.ID(), a.ord)
		a.cur.pad = a.padding
		a.ord++
		cost += int64(len(key)) + sampleOverhead
	}
	if a.cur.skip {
		return nil // delivered before the resume: its members are passed over
	}
	if a.bad == "" {
		a.bad = badName(key, ext)
	}
	if a.bad == "" && len(a.cur.Fields) >= maxFields {
		a.bad = fmt.Sprintf("it has more than %d fields", maxFields)
	}
	tooLarge := a.bad == "" && (a.cur.cost+cost > a.window || a.cur.cost+cost > a.batchLimit)
	if tooLarge {
		a.bad = fmt.Sprintf("it takes more than the %d bytes the read-ahead budget (%d) leaves for a sample",
			min(a.window, a.batchLimit), a.opts.ReadAheadBytes)
	}
	if a.bad != "" {
		switch {
		case a.spec.SkipCorrupt:
			a.inWindow -= a.cur.cost
			a.mem.Release(a.cur.cost) // what it had; the rest of its members are passed over
			a.cur.Fields, a.cur.cost = nil, 0
			return nil
		case tooLarge:
			return budget.Wrap(fmt.Errorf("%w: sample %s of shard %s: %s; raise it, or skip_corrupt skips such samples",
				ErrTooLarge, printable(key), printable(sh.Name), a.bad), budget.ReadAhead)
		}
		return corrupt(sh, "member %s: %s (skip_corrupt skips such samples)", printable(name), a.bad)
	}
	if err := a.room(cost); err != nil {
		return err
	}
	if err := a.mem.Acquire(a.ctx, cost); err != nil {
		return err
	}
	a.inWindow += cost
	a.cur.cost += cost
	data, err := get()
	if err != nil {
		return err
	}
	a.cur.Fields = append(a.cur.Fields, Field{Name: strings.Clone(ext), Data: data})
	return nil
}

// emptySample adds a sample with no fields (a Parquet row whose every
// column is null), charged its key, as member charges a first field.
func (a *assembler) emptySample(sh Shard, key string) error {
	key = sh.src.keyPrefix + key
	if err := a.endSample(); err != nil {
		return err
	}
	a.cur = &Sample{Key: strings.Clone(key), shard: sh.ID(), ord: a.ord, keep: a.keep}
	a.cur.skip = !a.padding && a.spec.Delivered != nil && a.spec.Delivered.Has(sh.ID(), a.ord)
	a.cur.pad = a.padding
	a.ord++
	if a.cur.skip {
		return nil
	}
	if a.bad = badName(key, ""); a.bad != "" {
		if a.spec.SkipCorrupt {
			return nil
		}
		return corrupt(sh, "row %s: %s (skip_corrupt skips such samples)", printable(key), a.bad)
	}
	cost := int64(len(key)) + sampleOverhead
	if err := a.room(cost); err != nil {
		return err
	}
	if err := a.mem.Acquire(a.ctx, cost); err != nil {
		return err
	}
	a.inWindow += cost
	a.cur.cost = cost
	return nil
}

// room makes cost bytes of room in the window by taking samples out of
// it, in the order the shuffle generator chooses. (The sample being read
// fits alone: member checked that.)
func (a *assembler) room(cost int64) error {
	for a.inWindow+cost > a.window && a.shuf.len() > 0 {
		if err := a.emit(a.shuf.pop()); err != nil {
			return err
		}
	}
	return nil
}

// endSample puts the sample read into the shuffle window (or counts it
// skipped).
func (a *assembler) endSample() error {
	s := a.cur
	if s == nil {
		return nil
	}
	a.cur = nil
	if s.skip {
		return nil
	}
	if a.bad != "" {
		a.bad = ""
		a.it.count(func(st *Stats) { st.CorruptSkipped++ })
		return nil
	}
	if a.padding {
		return a.emit(*s) // repeats come in file order, after the rank's own samples
	}
	if out, ok := a.shuf.push(*s); ok {
		return a.emit(out)
	}
	return nil
}

// dropSample forgets the sample being read (its shard failed).
func (a *assembler) dropSample() {
	if a.cur != nil {
		a.inWindow -= a.cur.cost
		a.mem.Release(a.cur.cost)
	}
	a.cur, a.bad = nil, ""
}

// emit skips the samples before spec.Start and batches the rest; in an
// even epoch it stops at the rank's share (errEnough).
func (a *assembler) emit(s Sample) error {
	if a.it.even != nil {
		ok, err := a.it.even.allows(a.ctx, a.seen+1)
		if !ok || err != nil {
			a.inWindow -= s.cost
			a.mem.Release(s.cost)
			return cmp.Or(err, errEnough)
		}
	}
	a.seen++
	a.inWindow -= s.cost
	if a.seen <= a.spec.Start {
		a.mem.Release(s.cost)
		if !s.pad {
			a.it.skipped(s.shard, s.ord) // delivered before the resume
		}
		return nil
	}
	if s.pad {
		a.it.count(func(st *Stats) { st.Padded++ })
	}
	a.batch = append(a.batch, s)
	a.batchCost += s.cost
	a.batchMeta += metaCost(&s)
	a.pos = a.seen
	switch {
	case a.batchCost > a.batchLimit:
		return budget.Wrap(fmt.Errorf("%w: a batch of %d samples takes more than the %d bytes the read-ahead budget (%d) leaves for a batch; "+
			"lower batch_size or raise the budget", ErrTooLarge, len(a.batch), a.batchLimit, a.opts.ReadAheadBytes), budget.ReadAhead)
	case a.batchMeta > maxBatchMeta:
		return fmt.Errorf("%w: the keys and field names of a batch of %d samples take more than %d bytes; lower batch_size",
			ErrTooLarge, len(a.batch), maxBatchMeta)
	}
	if len(a.batch) < a.spec.BatchSize {
		return nil
	}
	return a.sendBatch()
}

// emitAll emits samples in order.
func (a *assembler) emitAll(samples []Sample) error {
	for _, s := range samples {
		if err := a.emit(s); err != nil {
			return err
		}
	}
	return nil
}

// sendBatch hands the batch over; its bytes stay charged until the
// consumer releases it.
func (a *assembler) sendBatch() error {
	cost := a.batchCost
	b := &Batch{Samples: a.batch, Position: a.pos, release: func() { a.mem.Release(cost) }}
	a.batch, a.batchCost, a.batchMeta = nil, 0, 0
	if !a.send(result{batch: b}) {
		b.Release()
		return a.ctx.Err()
	}
	return nil
}

// finish ends the epoch: the window is emptied in random order and the
// last, short batch sent.
func (a *assembler) finish() error {
	if err := a.endSample(); err != nil {
		return err
	}
	if err := a.emitAll(a.shuf.flush()); err != nil {
		return err
	}
	if err := a.pad(); err != nil {
		return err
	}
	if len(a.batch) > 0 {
		return a.sendBatch()
	}
	return nil
}

// pad delivers, in an even epoch whose share this rank's samples fall
// short of, the samples of the epoch's shard order again from its first
// shard, in file order, until the share is reached (errEnough).
func (a *assembler) pad() error {
	if a.it.even == nil {
		return nil
	}
	a.it.state.Store(stateStorage) // the other ranks' shards are being counted
	target, err := a.it.even.final(a.ctx)
	a.it.state.Store(stateWork)
	if err != nil || a.seen >= target {
		return err
	}
	a.padding = true
	for {
		before := a.seen
		for _, sh := range a.it.left {
			if err := a.padShard(sh); err != nil {
				return err
			}
		}
		if a.seen == before { // the counts promised samples no shard delivers
			return fmt.Errorf("%w: pad the epoch to %d samples: the dataset's shards deliver none after %d", ErrCorruptShard, target, a.seen)
		}
	}
}

// padShard reads one shard to pad the epoch with, as fetchAll would.
func (a *assembler) padShard(sh Shard) error {
	p := &pendingShard{shard: sh, done: make(chan struct{}), release: func() {}}
	close(p.done)
	stream, err := streamed(sh, a.opts)
	if err != nil {
		return err
	}
	if stream {
		p.stream, p.how = true, fromStorage
	} else {
		w := sh.weight()
		if err := a.it.shardsMem.Acquire(a.ctx, w); err != nil {
			return err
		}
		p.release = func() { a.it.shardsMem.Release(w) }
		p.data, p.held, p.how, p.err = a.it.cache.get(a.ctx, sh.src.b, sh.src.prefix, sh, readAt{}, func() { p.miss.Store(true) })
	}
	defer p.release()
	return a.shard(p)
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
	it.count(func(st *Stats) {
		if how == fromCache {
			st.CacheHits++
		} else {
			st.CacheMisses++
		}
	})
}

// rangeReader reads size bytes of an object as one stream, reopening it
// at the offset reached (a ranged GET) when a read fails, a few times.
// Its errors are readErrors: storage's, not the shard's.
type rangeReader struct {
	ctx      context.Context
	b        storage.Backend
	name     string
	off      int64
	size     int64
	rc       io.ReadCloser
	reopened int
}

const maxReopens = 3

func (r *rangeReader) Read(p []byte) (int, error) {
	if r.off >= r.size {
		return 0, io.EOF
	}
	p = p[:min(int64(len(p)), r.size-r.off)]
	for {
		if r.rc == nil {
			rc, err := r.b.Get(r.ctx, r.name, r.off, r.size-r.off)
			if err != nil {
				return 0, readError{fmt.Errorf("read shard %s: %w", printable(r.name), err)}
			}
			r.rc = rc
		}
		n, err := r.rc.Read(p)
		r.off += int64(n)
		if err == nil || n > 0 {
			return n, nil // an error comes again with the next read
		}
		r.Close()
		switch {
		case r.ctx.Err() != nil:
			return 0, r.ctx.Err()
		case errors.Is(err, io.EOF):
			return 0, readError{fmt.Errorf("read shard %s: it ends at byte %d, before the %d bytes listed (changed since?)", printable(r.name), r.off, r.size)}
		case r.reopened >= maxReopens:
			return 0, readError{fmt.Errorf("read shard %s at byte %d: %w", printable(r.name), r.off, err)}
		}
		r.reopened++
	}
}

func (r *rangeReader) Close() error {
	if r.rc == nil {
		return nil
	}
	err := r.rc.Close()
	r.rc = nil
	return err
}
