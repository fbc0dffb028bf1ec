package prefetch

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/ckptd/ckptd/storage"
)

// Even says how an epoch's samples are shared out among its ranks. Shards
// are dealt whole, so ranks get as many samples as their shards hold: a
// job whose ranks step together (DDP: every step is a collective) would
// hang at the epoch's end, the ranks with more samples waiting for the
// others. EvenPad and EvenDrop give every rank the same count.
type Even string

const (
	// EvenPad (the default): every rank delivers as many samples as the
	// rank with the most; one with fewer repeats, after its own, the first
	// samples of the epoch's shard order (in file order). The repeats are
	// counted (Stats.Padded) and never part of a Delivered position.
	EvenPad Even = "pad"
	// EvenDrop: every rank delivers as many samples as the rank with the
	// fewest; the others leave out the last samples of their order.
	EvenDrop Even = "drop"
	// EvenOff: each rank delivers its shards' samples, as many as they hold.
	EvenOff Even = "off"
)

// ParseEven checks an Even name; "" is EvenPad.
func ParseEven(s string) (Even, error) {
	switch e := Even(s); e {
	case EvenPad, EvenDrop, EvenOff:
		return e, nil
	case "":
		return EvenPad, nil
	}
	return "", fmt.Errorf("%w: unknown even %q (want pad, drop or off)", ErrInvalid, s)
}

// epochOrder is the epoch's permutation of all shards, seeded by (seed,
// epoch), without the shards delivered (if not nil) holds whole: a
// resumed epoch deals what is left.
func epochOrder(shards []Shard, seed uint64, epoch int64, delivered *Delivered) []Shard {
	perm := shardPerm(len(shards), seed, epoch)
	left := make([]Shard, 0, len(shards))
	for _, i := range perm {
		if delivered == nil || !delivered.Done(shards[i].ID()) {
			left = append(left, shards[i])
		}
	}
	return left
}

// deal is rank's part of an epoch's order: every world_size-th shard.
func deal(left []Shard, rank, worldSize int) []Shard {
	var mine []Shard
	for i := rank; i < len(left); i += worldSize {
		mine = append(mine, left[i])
	}
	return mine
}

// errEnough stops an iteration that has delivered its even share.
var errEnough = errors.New("the rank's even share is delivered")

// evenTarget is how many samples every rank of an even epoch delivers,
// once the samples of every shard dealt are counted. Until then lower is
// what every rank holds at least (the fewest among the ranks' counted
// shards), which lets a dropping rank deliver that far without waiting.
type evenTarget struct {
	mode    Even
	mu      sync.Mutex
	changed chan struct{} // closed and replaced when lower, target or err change
	lower   int64
	target  int64 // -1 until every shard is counted
	err     error
}

// countWorkers bounds the shards one iteration counts at once.
const countWorkers = 4

// newEvenTarget counts the samples of the shards of left (the epoch's
// order, dealt round-robin to worldSize ranks) in the background, less
// those delivered holds, and sets the target from them.
func newEvenTarget(ctx context.Context, mode Even, cache *Cache, left []Shard, worldSize int, delivered *Delivered) *evenTarget {
	e := &evenTarget{mode: mode, changed: make(chan struct{}), target: -1}
	go e.count(ctx, cache, left, worldSize, delivered)
	return e
}

func (e *evenTarget) count(ctx context.Context, cache *Cache, left []Shard, worldSize int, delivered *Delivered) {
	partial := make([]int64, worldSize) // samples counted so far, by rank
	missing := make([]int, worldSize)   // shards not counted yet, by rank
	for i := range left {
		missing[i%worldSize]++
	}
	jobs := make(chan int)
	type counted struct {
		i   int
		n   int
		err error
	}
	results := make(chan counted)
	for range min(countWorkers, len(left)) {
		go func() {
			for i := range jobs {
				src := left[i].src
				n, err := cache.counts.count(ctx, src.b, src.prefix, src.format, left[i])
				select {
				case results <- counted{i, n, err}:
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	go func() {
		defer close(jobs)
		for i := range left {
			select {
			case jobs <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	for range left {
		var r counted
		select {
		case r = <-results:
		case <-ctx.Done():
			e.set(0, ctx.Err())
			return
		}
		if r.err != nil {
			e.set(0, fmt.Errorf("count the samples of shard %s for an even epoch: %w", printable(left[r.i].Name), r.err))
			return
		}
		rank := r.i % worldSize
		partial[rank] += int64(r.n - delivered.countBelow(left[r.i].ID(), r.n))
		missing[rank]--
		e.set(lowerBound(partial), nil)
	}
	target := partial[0]
	for _, n := range partial {
		if e.mode == EvenDrop {
			target = min(target, n)
		} else {
			target = max(target, n)
		}
	}
	e.mu.Lock()
	e.target = target
	e.notify()
	e.mu.Unlock()
}

// lowerBound is what every rank holds at least, from what is counted.
func lowerBound(partial []int64) int64 {
	low := partial[0]
	for _, n := range partial {
		low = min(low, n)
	}
	return low
}

func (e *evenTarget) set(lower int64, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		e.err = err
	} else {
		e.lower = max(e.lower, lower)
	}
	e.notify()
}

// notify wakes the waiters; call with mu.
func (e *evenTarget) notify() {
	close(e.changed)
	e.changed = make(chan struct{})
}

// allows waits until it is known whether the n-th sample of the rank's
// order (counted from 1) is delivered: with drop, as soon as every rank
// surely has n; otherwise (pad) only once the target is known, since a
// padded rank delivers every sample it has.
func (e *evenTarget) allows(ctx context.Context, n int64) (bool, error) {
	for {
		e.mu.Lock()
		target, lower, err, changed := e.target, e.lower, e.err, e.changed
		e.mu.Unlock()
		switch {
		case target >= 0:
			return n <= target, nil
		case err != nil:
			return false, err
		case e.mode != EvenDrop || n <= lower:
			return true, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
}

// final waits for the target.
func (e *evenTarget) final(ctx context.Context) (int64, error) {
	for {
		e.mu.Lock()
		target, err, changed := e.target, e.err, e.changed
		e.mu.Unlock()
		switch {
		case target >= 0:
			return target, nil
		case err != nil:
			return 0, err
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// sampleCounts remembers how many samples each shard holds, for every
// iteration of the node, within a byte budget (a full one starts over:
// counts are cheap to make again), and counts each shard once for all the
// iterations that want it at the same time.
type sampleCounts struct {
	mu      sync.Mutex
	counts  map[string]int
	cost    int64
	budget  int64
	flights map[string]*countFlight
}

type countFlight struct {
	done chan struct{}
	n    int
	err  error
}

// CountBytes bounds the memory the shards' sample counts take (the
// datasets read with even pad or drop): part of MemoryCeiling.
const CountBytes = 32 << 20

func newSampleCounts(budget int64) *sampleCounts {
	return &sampleCounts{counts: map[string]int{}, budget: budget, flights: map[string]*countFlight{}}
}

// count returns how many samples shard sh of format f holds.
func (sc *sampleCounts) count(ctx context.Context, b storage.Backend, prefix string, f Format, sh Shard) (int, error) {
	if f == Raw {
		return 1, nil
	}
	if n, ok := sh.knownCount(); ok {
		return n, nil // the format's metadata says
	}
	key := shardKey(b, sh)
	for {
		sc.mu.Lock()
		if n, ok := sc.counts[key]; ok {
			sc.mu.Unlock()
			return n, nil
		}
		fl := sc.flights[key]
		if fl == nil {
			fl = &countFlight{done: make(chan struct{})}
			sc.flights[key] = fl
			sc.mu.Unlock()
			fl.n, fl.err = countSamples(ctx, b, sh)
			sc.mu.Lock()
			delete(sc.flights, key)
			if fl.err == nil {
				sc.remember(key, fl.n)
			}
			sc.mu.Unlock()
			close(fl.done)
			return fl.n, fl.err
		}
		sc.mu.Unlock()
		select {
		case <-fl.done:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		if fl.err == nil {
			return fl.n, nil
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		if !errors.Is(fl.err, context.Canceled) {
			return 0, fl.err
		}
		// Its counter stopped (its iteration closed): count it ourselves.
	}
}

// learn records the count of a shard an iteration parsed whole.
func (sc *sampleCounts) learn(b storage.Backend, sh Shard, n int) {
	sc.mu.Lock()
	defer sc.mu.Unlock()
	sc.remember(shardKey(b, sh), n)
}

// remember records a count; call with mu.
func (sc *sampleCounts) remember(key string, n int) {
	cost := int64(len(key)) + 64
	if sc.cost+cost > sc.budget {
		sc.counts, sc.cost = map[string]int{}, 0
	}
	sc.counts[key] = n
	sc.cost += cost
}

// countSamples counts a tar shard's samples as the assembler cuts them: runs
// of regular members with an extension sharing a key. It reads the
// members' headers only, skipping their data. A shard damaged part way
// counts the samples complete before the damage (the assembler delivers
// those); a read that fails is an error.
func countSamples(ctx context.Context, b storage.Backend, sh Shard) (int, error) {
	r := newSkipReader(ctx, b, sh)
	defer r.Close()
	n, cur := 0, ""
	err := walkTar(r, r.pos, sh.Size, func(m member) error {
		if key, _ := splitKey(m.name); n == 0 || key != cur {
			n, cur = n+1, key
		}
		return nil
	})
	var re readError
	switch {
	case err == nil:
		return n, nil
	case errors.As(err, &re) || ctx.Err() != nil:
		return 0, err
	case n > 0:
		return n - 1, nil // the sample cut by the damage is not delivered
	}
	return 0, nil
}

// skipReader reads an object as a stream that can skip ahead (io.Seeker,
// which archive/tar uses to pass over members' data): a short skip reads
// through, a longer one opens the object again where it lands (a ranged
// read). From a local source a skip of more than 8 KiB reopens (a syscall
// or two), so counting reads little more than the headers; from S3 only a
// skip of more than 1 MiB does (a request costs about what reading 1 MiB
// does), so a shard of small samples is read through.
type skipReader struct {
	ctx   context.Context
	b     storage.Backend
	name  string
	size  int64
	off   int64 // where the reader stands
	at    int64 // where the open stream stands
	rc    io.ReadCloser
	br    *bufio.Reader
	bufSz int
	skip  int64 // skips up to this are read through
}

func newSkipReader(ctx context.Context, b storage.Backend, sh Shard) *skipReader {
	r := &skipReader{ctx: ctx, b: b, name: sh.Name, size: sh.Size, bufSz: 64 << 10, skip: 1 << 20}
	if _, ok := localOf(b); ok { // a reopen is a syscall or two
		r.bufSz, r.skip = 8<<10, 8<<10
	}
	return r
}

func (r *skipReader) pos() int64 { return r.off }

func (r *skipReader) Seek(offset int64, whence int) (int64, error) {
	switch whence {
	case io.SeekStart:
	case io.SeekCurrent:
		offset += r.off
	case io.SeekEnd:
		offset += r.size
	default:
		return 0, errors.New("bad whence")
	}
	if offset < 0 {
		return 0, errors.New("negative position")
	}
	r.off = offset
	return offset, nil
}

func (r *skipReader) Read(p []byte) (int, error) {
	if r.off >= r.size {
		return 0, io.EOF
	}
	if r.rc != nil && (r.off < r.at || r.off-r.at > r.skip) {
		r.Close()
	}
	if r.rc == nil {
		rc, err := r.b.Get(r.ctx, r.name, r.off, r.size-r.off)
		if err != nil {
			return 0, readError{fmt.Errorf("read shard %s: %w", printable(r.name), err)}
		}
		r.rc, r.at = rc, r.off
		r.br = bufio.NewReaderSize(rc, r.bufSz)
	}
	if d := r.off - r.at; d > 0 {
		n, err := r.br.Discard(int(d))
		r.at += int64(n)
		if err != nil {
			return 0, r.failed(err)
		}
	}
	n, err := r.br.Read(p[:min(int64(len(p)), r.size-r.off)])
	r.off += int64(n)
	r.at += int64(n)
	if n > 0 {
		return n, nil
	}
	return 0, r.failed(err)
}

func (r *skipReader) failed(err error) error {
	if errors.Is(err, io.EOF) {
		return readError{fmt.Errorf("read shard %s: it ends at byte %d, before the %d bytes listed (changed since?)", printable(r.name), r.at, r.size)}
	}
	return readError{fmt.Errorf("read shard %s at byte %d: %w", printable(r.name), r.at, err)}
}

// Close closes the open stream, if any.
func (r *skipReader) Close() error {
	if r.rc == nil {
		return nil
	}
	err := r.rc.Close()
	r.rc, r.br = nil, nil
	return err
}
