package prefetch

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// session is one rank's epoch: a filler goroutine moves batches from the
// iterator into ring slots, ahead of the consumer by up to the ring's size.
// It starts at open, before the first request. The first batch, when one
// of the shards before it came from storage, is handed out once the ring
// is full (or the epoch over), waiting for that at most as long again as
// the first batch took to come (primeWait): a consumer
// that starts with an empty ring and takes batches nearly as fast as
// storage reads them has no lead to absorb a late shard, and would wait
// again and again in its first seconds; a full ring is its lead.
//
// Deliveries are released in the order they were delivered: releasing one
// also releases those delivered before it that are still held. A delivery
// whose response never reached the client (its call timed out as the batch
// came) is one the client cannot name; it is handed out again by the next
// call when the service learns the response was not sent (Undeliver), and
// otherwise freed by the client's next release, or handed out again when
// the client asks for a batch while holding every turn of the ring (which
// it cannot do knowingly: no batch could come). So a client that times out
// calls loses no slot and never waits for good.
type session struct {
	id     string
	owner  string // Owner.ID
	peer   string // Owner.Peer
	source string
	spec   Spec
	it     *Iterator
	ring   *Ring
	filled chan *Delivery
	primed chan struct{} // closed once the ring is full, the filler ends, or primeWait passed
	// primeTimer starts the primeWait timer: time.AfterFunc, but for a
	// test that tells a start that waits for the ring from one that does
	// not, whatever the machine's speed.
	primeTimer func(time.Duration, func()) *time.Timer
	prime      sync.Once
	opened     time.Time
	state      atomic.Int32 // fillerIterating, or a Cause the filler waits on
	// ringFull says the filler waited for a turn since the consumer last
	// found no batch ready; grow asks the filler to add a slot.
	ringFull, grow atomic.Bool
	err            error // the filler's, valid once filled is closed
	cancel         context.CancelFunc
	done           chan struct{}
	closed         sync.Once
	onClose        func()       // after the ring is freed (releases the backend)
	used           atomic.Int64 // unix nanos of the last call
	m              *Metrics

	mu     sync.Mutex
	gone   bool // closed: what a call still brings back is released at once
	held   map[string]heldDelivery
	seq    uint64
	redo   []*Delivery      // not sent: handed out again first, by position
	redone chan struct{}    // a delivery was put back in redo
	recent []string         // ids released lately, so that a retried release is no error
	stall  [4]time.Duration // by Cause
	last   Stats            // as last reported to metrics
}

type heldDelivery struct {
	d   *Delivery
	seq uint64 // order of delivery
}

const fillerIterating = -1

// newSession starts a session's filler; primeTimer starts its primeWait
// timer (time.AfterFunc).
func newSession(id, owner string, it *Iterator, ring *Ring, m *Metrics, primeTimer func(time.Duration, func()) *time.Timer) *session {
	ctx, cancel := context.WithCancel(context.Background())
	ss := &session{
		id: id, owner: owner, it: it, ring: ring, filled: make(chan *Delivery, ring.Max()), primeTimer: primeTimer,
		cancel: cancel, done: make(chan struct{}), held: map[string]heldDelivery{}, m: m,
		redone: make(chan struct{}, 1), primed: make(chan struct{}), opened: time.Now(),
	}
	ss.touch()
	go func() {
		defer close(ss.done)
		ss.err = ss.fill(ctx)
		close(ss.filled)
	}()
	return ss
}

func (ss *session) touch()              { ss.used.Store(time.Now().UnixNano()) }
func (ss *session) lastUsed() time.Time { return time.Unix(0, ss.used.Load()) }

// minPrimeWait is the least primeWait: a first batch that came at once
// (from the cache) may still wait this long for the ring to fill.
const minPrimeWait = 50 * time.Millisecond

// primeWait bounds how long the first batch waits, once ready, for the
// ring to fill: as long as it took to come since the session opened.
func primeWait(first time.Duration) time.Duration { return max(first, minPrimeWait) }

// markPrimed lets the first batch be handed out.
func (ss *session) markPrimed() { ss.prime.Do(func() { close(ss.primed) }) }

// fill runs the iterator into the ring until the epoch ends.
func (ss *session) fill(ctx context.Context) error {
	defer ss.markPrimed()
	first := true
	for {
		ss.state.Store(fillerIterating)
		b, err := ss.it.Next(ctx)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		ss.growIfAsked()
		d, err := ss.ring.Fill(ctx, b, func() {
			ss.ringFull.Store(true)
			ss.state.Store(int32(CauseRing))
		})
		if err == nil && ss.it.spec.BatchDelivered {
			d.Delivered = ss.it.batchDelivered(b)
		}
		b.Release() // copied (or failed): its memory goes back to the read-ahead budget
		if err != nil {
			return err
		}
		ss.state.Store(int32(CauseWork))
		select {
		case ss.filled <- d:
		case <-ctx.Done():
			ss.ring.Release(d)
			return ctx.Err()
		}
		if first {
			first = false
			if ss.it.Stats().CacheMisses == 0 {
				ss.markPrimed() // from the cache: no shard will be late, and a wait would only delay the start
			}
			t := ss.primeTimer(primeWait(time.Since(ss.opened)), ss.markPrimed)
			defer t.Stop()
		}
		if len(ss.filled) >= ss.ring.Slots() {
			ss.markPrimed() // every turn of the ring is taken: nothing more can come before the consumer takes one
		}
	}
}

// growIfAsked adds a ring slot when the consumer asked for one (next): it
// found no batch ready although the ring had been full since it last did,
// so the ring, not storage, bounded its lead. A slot more lets the filler
// run further ahead while the consumer is slower than storage, and absorb
// a longer hiccup after; the ring grows this way up to --ring-slots-max.
func (ss *session) growIfAsked() {
	if ss.grow.Swap(false) && ss.ring.Grow() {
		ss.m.RingGrown.Inc()
	}
}

// behind says the consumer has caught up with the producer: no batch is
// in the ring or ready to be copied into it, and the filler waits for the
// iterator (storage or parsing), not for a turn of the ring.
func (ss *session) behind() bool {
	return len(ss.filled) == 0 && len(ss.it.batches) == 0 && ss.state.Load() == fillerIterating
}

// cause is what a consumer that starts waiting now is waiting on.
func (ss *session) cause() Cause {
	st := ss.state.Load()
	if st == fillerIterating {
		return ss.it.Waiting()
	}
	if Cause(st) == CauseRing && len(ss.ring.turns) < cap(ss.ring.turns) {
		return CauseWork // a delivery was just released; the filler is about to copy
	}
	return Cause(st)
}

func (ss *session) next(ctx context.Context) (*Delivery, string, Stats, error) {
	start, cause := time.Now(), ss.cause()
	select {
	case <-ss.primed: // at once after the first batch
		if ss.behind() && ss.ringFull.Swap(false) {
			ss.grow.Store(true) // the consumer caught up with a ring that had been full
		}
	case <-ctx.Done():
		return nil, "", ss.stats(), ctx.Err()
	}
	for {
		if d := ss.takeRedo(); d != nil {
			return ss.hand(ctx, d)
		}
		if d, seq := ss.stuck(); d != nil {
			return ss.handAs(ctx, d, seq)
		}
		var d *Delivery
		var ok bool
		select {
		case d, ok = <-ss.filled:
		case <-ss.redone:
			continue
		case <-ctx.Done():
			return nil, "", ss.stats(), ctx.Err()
		}
		waited := time.Since(start)
		ss.mu.Lock()
		ss.stall[cause] += waited
		ss.mu.Unlock()
		ss.m.Wait.WithLabelValues(cause.String()).Add(waited.Seconds())
		if !ok {
			if d := ss.takeRedo(); d != nil { // put back while we waited
				return ss.hand(ctx, d)
			}
			if ss.err != nil {
				return nil, "", ss.stats(), ss.err
			}
			return nil, "", ss.stats(), io.EOF
		}
		ss.report(len(d.Samples))
		return ss.hand(ctx, d)
	}
}

// hand registers d as held by the client under a new id, unless the call
// is over (then it waits for the next one) or the session closed.
func (ss *session) hand(ctx context.Context, d *Delivery) (*Delivery, string, Stats, error) {
	return ss.handAs(ctx, d, 0)
}

// handAs is hand keeping the order seq of a delivery handed out before (0:
// a new one).
func (ss *session) handAs(ctx context.Context, d *Delivery, seq uint64) (*Delivery, string, Stats, error) {
	if err := ctx.Err(); err != nil {
		ss.putBack(d)
		return nil, "", ss.stats(), err
	}
	lease := newID()
	ss.mu.Lock()
	if ss.gone {
		ss.mu.Unlock()
		ss.ring.Release(d)
		return nil, "", Stats{}, unknownSession(ss.id)
	}
	if seq == 0 {
		ss.seq++
		seq = ss.seq
	}
	ss.held[lease] = heldDelivery{d, seq}
	ss.mu.Unlock()
	return d, lease, ss.stats(), nil
}

// stuck takes back the oldest held delivery when the client holds every
// turn of the ring: it asks for a batch that could then never come, so it
// cannot have seen them all (a response lost as its call timed out). The
// batch is handed out again; its old id stays releasable.
func (ss *session) stuck() (*Delivery, uint64) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if len(ss.held) < ss.ring.Slots() {
		return nil, 0
	}
	var oldest string
	for id, h := range ss.held {
		if oldest == "" || h.seq < ss.held[oldest].seq {
			oldest = id
		}
	}
	h := ss.held[oldest]
	delete(ss.held, oldest)
	ss.remember(oldest)
	return h.d, h.seq
}

// remember notes a released id, so that releasing it again is no error.
func (ss *session) remember(id string) {
	ss.recent = append(ss.recent, id)
	if n := 2 * cap(ss.filled); len(ss.recent) > n {
		ss.recent = slices.Delete(ss.recent, 0, len(ss.recent)-n)
	}
}

func (ss *session) takeRedo() *Delivery {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if len(ss.redo) == 0 {
		return nil
	}
	d := ss.redo[0]
	ss.redo = ss.redo[1:]
	if len(ss.redo) > 0 {
		ss.signalRedo() // for another waiting call
	}
	return d
}

// signalRedo wakes a call waiting for a batch: one was put back.
func (ss *session) signalRedo() {
	select {
	case ss.redone <- struct{}{}:
	default:
	}
}

// putBack queues d to be handed out again, before anything delivered after it.
func (ss *session) putBack(d *Delivery) {
	ss.mu.Lock()
	if ss.gone {
		ss.mu.Unlock()
		ss.ring.Release(d)
		return
	}
	i, _ := slices.BinarySearchFunc(ss.redo, d.Position, func(r *Delivery, pos int64) int { return cmp.Compare(r.Position, pos) })
	ss.redo = slices.Insert(ss.redo, i, d)
	ss.mu.Unlock()
	ss.signalRedo()
}

// undeliver takes back a delivery whose response was not sent, to hand it
// out again.
func (ss *session) undeliver(lease string) {
	ss.mu.Lock()
	h, ok := ss.held[lease]
	delete(ss.held, lease)
	ss.mu.Unlock()
	if ok {
		ss.putBack(h.d)
	}
}

// release frees the delivery lease and every one delivered before it.
// Releasing one released lately is no error (a retried call); an id the
// session never handed out is.
func (ss *session) release(lease string) error {
	ss.mu.Lock()
	h, ok := ss.held[lease]
	if !ok {
		known := slices.Contains(ss.recent, lease)
		ss.mu.Unlock()
		if known {
			return nil
		}
		return fmt.Errorf("%w: no delivery %q held in session %s", ErrUnknownSession, lease, ss.id)
	}
	var out []*Delivery
	for id, o := range ss.held {
		if o.seq <= h.seq {
			out = append(out, o.d)
			delete(ss.held, id)
			ss.remember(id)
		}
	}
	ss.mu.Unlock()
	for _, d := range out {
		ss.ring.Release(d)
	}
	return nil
}

// stats merges the iterator's cache counts with the consumer's stalls.
func (ss *session) stats() Stats {
	st := ss.it.Stats()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	st.WaitWork, st.WaitStorage, st.WaitCache, st.WaitRing = ss.stall[CauseWork], ss.stall[CauseStorage], ss.stall[CauseCache], ss.stall[CauseRing]
	return st
}

// report adds what happened since the last report to the metrics.
func (ss *session) report(samples int) {
	st := ss.it.Stats()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.m.Samples.Add(float64(samples))
	ss.m.CacheHits.Add(float64(st.CacheHits - ss.last.CacheHits))
	ss.m.CacheMisses.Add(float64(st.CacheMisses - ss.last.CacheMisses))
	ss.m.Corrupt.Add(float64(st.CorruptSkipped - ss.last.CorruptSkipped))
	ss.last = st
}

// close stops the filler and frees every region, held or queued. Only
// the first call does anything.
func (ss *session) close() { ss.closed.Do(ss.shut) }

func (ss *session) shut() {
	ss.cancel()
	ss.it.Close()
	<-ss.done
	for d := range ss.filled {
		ss.ring.Release(d)
	}
	ss.mu.Lock()
	ss.gone = true
	held, redo := ss.held, ss.redo
	ss.held, ss.redo = nil, nil
	ss.mu.Unlock()
	for _, h := range held {
		ss.ring.Release(h.d)
	}
	for _, d := range redo {
		ss.ring.Release(d)
	}
	ss.ring.Close()
	if ss.onClose != nil {
		ss.onClose()
	}
}
