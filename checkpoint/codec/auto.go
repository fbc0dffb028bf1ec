package codec

import (
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// ForDType returns the codec with the best ratio for chunks of d: the
// float-aware codec of its width for IEEE floating point (F16, BF16, F32,
// F64), zstd for the rest (integers, bools, fp8 and fp4, complex, torch's
// bit containers, a dtype it does not know: bytes), where LZ matches and
// literal entropy are what there is to find.
func ForDType(d dtype.DType) Codec {
	switch d {
	case dtype.BF16:
		return FloatBF16
	case dtype.F16:
		return FloatF16
	case dtype.F32:
		return FloatF32
	case dtype.F64:
		return FloatF64
	}
	return Zstd
}

// candidates lists what auto may use for d, best ratio first. For floats,
// zstd and lz4 are left out: on float data they are both slower and worse
// than the float codec (zstd) or no better than none (lz4).
func candidates(d dtype.DType) []Codec {
	if c := ForDType(d); c != Zstd {
		return []Codec{c, None}
	}
	return []Codec{Zstd, LZ4, None}
}

// Selector is the policy behind the Auto setting. It picks, per chunk, the
// codec that maximizes the drain rate it predicts from measurements:
//
//	drain(c) = min(workers × produce(c), storage / stored(c))
//
// where produce(c) is the raw bytes per second one worker gets through with
// c (hash + compress, wall clock), stored(c) the stored/raw ratio, and
// storage the rate in stored bytes per second at which the backend takes
// data while it is busy. The first term is how fast the workers can
// produce, the second how fast storage can absorb what they produce. With
// slow storage the second term rules and the best ratio wins; with fast
// storage and few cores the first rules and a cheaper codec (in the end
// none) drains faster.
//
// Every estimate is an exponentially weighted moving average of what the
// writer reports (ObserveChunk, ObserveStorage), kept per dtype for the
// codec terms, since bf16 weights and int64 counters compress differently.
// Rates are averaged, not times: a worker descheduled for 10 ms on one
// chunk then pulls the estimate down by at most ewmaWeight, where an
// average of times would let one such outlier dominate.
//
// Before storage has been measured the best-ratio codec is used. A codec
// other than the one in use is tried on one chunk in exploreEvery of its
// dtype, so that its estimates follow the data; none needs no trials, as
// every chunk's hashing time is its cost. A switch needs a predicted gain
// of more than switchMargin, so that noise does not make the choice flap.
//
// A Selector is safe for concurrent use.
type Selector struct {
	workers     float64
	fixedRate   float64
	mu          sync.Mutex
	storage     ewma // stored bytes per second of backend busy time
	classes     map[dtype.DType]*class
	pendingB    int64
	pendingBusy time.Duration
}

// SelectorOptions configure a Selector.
type SelectorOptions struct {
	// Workers is how many chunks compress at once.
	Workers int
	// StorageRate, when positive, is the storage write rate (bytes/s) to
	// assume instead of measuring it: for storage of known speed, and for
	// tests that need a fixed choice.
	StorageRate float64
}

const (
	ewmaWeight   = 0.2
	exploreEvery = 16
	switchMargin = 1.1
	// A storage sample needs this much data and busy time, so that one
	// short write into the page cache does not count as the disk's speed.
	minSampleBytes = 4 << 20
	minSampleBusy  = 20 * time.Millisecond
)

// NewSelector returns a Selector with no measurements.
func NewSelector(o SelectorOptions) *Selector {
	return &Selector{workers: float64(max(o.Workers, 1)), fixedRate: o.StorageRate, classes: map[dtype.DType]*class{}}
}

// class is what the Selector knows about one dtype.
type class struct {
	cands   []Codec
	est     []estimate // per candidate
	hash    ewma       // raw bytes/s of the work every codec does (none's produce rate)
	current int        // index into cands
	chunks  int
}

type estimate struct {
	stored  ewma // stored/raw
	produce ewma // raw bytes/s for hash + compress
	last    int  // class.chunks when last measured
}

type ewma struct {
	v float64
	n int
}

func (e *ewma) add(x float64) {
	if e.n == 0 {
		e.v = x
	} else {
		e.v += ewmaWeight * (x - e.v)
	}
	e.n++
}

func (s *Selector) class(d dtype.DType) *class {
	cl := s.classes[d]
	if cl == nil {
		cl = &class{cands: candidates(d)}
		cl.est = make([]estimate, len(cl.cands))
		s.classes[d] = cl
	}
	return cl
}

// Choose returns the codec for the next chunk of dtype d.
func (s *Selector) Choose(d dtype.DType) Codec {
	s.mu.Lock()
	defer s.mu.Unlock()
	cl := s.class(d)
	cl.chunks++
	if i, ok := cl.explore(); ok {
		return cl.cands[i]
	}
	cl.current = s.best(cl)
	return cl.cands[cl.current]
}

// explore returns a candidate to try on this chunk instead of the current
// one: one never measured, as soon as the current one has been, and else,
// every exploreEvery chunks, the one measured longest ago. None is never
// tried: every chunk measures it.
func (cl *class) explore() (int, bool) {
	pick := -1
	for i, c := range cl.cands {
		if c != None && i != cl.current && (pick < 0 || cl.est[i].older(cl.est[pick])) {
			pick = i
		}
	}
	if pick < 0 {
		return 0, false
	}
	ready := cl.cands[cl.current] == None || cl.est[cl.current].stored.n > 0
	if ready && cl.est[pick].stored.n == 0 || cl.chunks%exploreEvery == 0 {
		return pick, true
	}
	return 0, false
}

// older reports whether e was measured before o (never counts as oldest).
func (e estimate) older(o estimate) bool {
	if e.stored.n == 0 || o.stored.n == 0 {
		return e.stored.n == 0 && o.stored.n != 0
	}
	return e.last < o.last
}

// best returns the candidate with the highest predicted drain rate, keeping
// the current one unless another beats it by switchMargin.
func (s *Selector) best(cl *class) int {
	rate := s.storageRate()
	if rate <= 0 || cl.hash.n == 0 || cl.est[0].stored.n == 0 {
		// Not measured yet: assume storage is the bottleneck, which
		// is also how the best-ratio codec gets its first measurement.
		return 0
	}
	cur := cl.current
	curRate := s.drain(cl, cur, rate)
	best, bestRate := cur, curRate
	for i := range cl.cands {
		if r := s.drain(cl, i, rate); r > bestRate {
			best, bestRate = i, r
		}
	}
	if best != cur && bestRate <= curRate*switchMargin && curRate > 0 {
		return cur
	}
	return best
}

// drain predicts the drain rate (raw bytes/s) with candidate i, or 0 when
// it has not been measured.
func (s *Selector) drain(cl *class, i int, storage float64) float64 {
	stored, produce := 1.0, cl.hash.v
	if cl.cands[i] != None {
		e := cl.est[i]
		if e.stored.n == 0 {
			return 0
		}
		stored, produce = max(e.stored.v, 1e-6), e.produce.v
	}
	return min(s.workers*produce, storage/stored)
}

func (s *Selector) storageRate() float64 {
	if s.fixedRate > 0 {
		return s.fixedRate
	}
	if s.storage.n == 0 {
		return 0
	}
	return s.storage.v
}

// ObserveChunk records one chunk of dtype d written with codec c: raw and
// stored sizes (stored == raw when it was kept raw), the time spent hashing
// and the time spent compressing (zero for none).
func (s *Selector) ObserveChunk(d dtype.DType, c Codec, raw, stored int, hash, compress time.Duration) {
	if raw <= 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cl := s.class(d)
	cl.hash.add(rate(raw, hash))
	for i, cand := range cl.cands {
		if cand == c && c != None {
			e := &cl.est[i]
			e.stored.add(float64(stored) / float64(raw))
			e.produce.add(rate(raw, hash+compress))
			e.last = cl.chunks
		}
	}
}

// rate is n bytes over d, with d at least a microsecond: a chunk hashed
// between two coarse clock ticks did not take zero time.
func rate(n int, d time.Duration) float64 {
	return float64(n) / max(d, time.Microsecond).Seconds()
}

// ObserveStorage records that the backend took n stored bytes while busy
// for the given time (time spent writing, not waiting for chunks). Small
// observations are pooled into one sample.
func (s *Selector) ObserveStorage(n int64, busy time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pendingB += n
	s.pendingBusy += busy
	if s.pendingB < minSampleBytes || s.pendingBusy < minSampleBusy {
		return
	}
	s.storage.add(float64(s.pendingB) / s.pendingBusy.Seconds())
	s.pendingB, s.pendingBusy = 0, 0
}

// StorageRate returns the measured storage rate in bytes/s (0 before the
// first sample), for logs and tests.
func (s *Selector) StorageRate() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.storageRate()
}
