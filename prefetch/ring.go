package prefetch

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/budget"
)

// FieldRef locates one field of a delivered sample in its region.
type FieldRef struct {
	Name           string
	Offset, Length int64 // relative to the region
}

// SampleRef is a delivered sample.
type SampleRef struct {
	Key    string
	Fields []FieldRef
}

// Delivery is a batch copied into a region of the arena.
type Delivery struct {
	Region   Region
	Samples  []SampleRef
	Position int64
	// Delivered is the batch's samples as an encoded position
	// (Spec.BatchDelivered; else nil).
	Delivered []byte
	slot      bool // a ring slot (else a one-off region for an oversized batch)
}

// Ring is a set of equal slots in the shared-memory arena that batches
// are copied into for the trainer to read: pre-faulted and locked with the
// arena, and registrable once with CUDA like the rest of it. A batch
// larger than a slot gets a region of its own, freed on release, so that
// oversized samples are still delivered; it takes one of the ring's turns
// like a slot, so a session never has more deliveries out than its ring
// has slots. Slots and oversized regions are charged to the datasets'
// share of the arena.
//
// A ring starts with n slots and may grow to max (Grow), one slot at a
// time, into room of the datasets' share that leaves a whole n-slot ring
// free for the next session to open; it keeps its slots until it closes.
type Ring struct {
	a        Arena
	budget   *arenaBudget
	wait     time.Duration // for arena space for an oversized batch
	slotSize int64
	base     int // slots at the start: the room a growth must leave free
	free     chan Region
	// turns holds a token per delivery not released, and one per slot the
	// ring may still grow by, so that its free capacity is the number of
	// turns left.
	turns chan struct{}
	size  atomic.Int32 // slots allocated

	mu     sync.Mutex
	slots  []Region // all, for Close
	closed bool
}

// newRing charges n slots of slotSize bytes to budget and allocates them
// from a, waiting up to wait for room (for an oversized batch too). The
// ring may grow to most slots (most < n means n).
func newRing(ctx context.Context, a Arena, share *arenaBudget, n, most int, slotSize int64, wait time.Duration) (*Ring, error) {
	if n <= 0 || slotSize <= 0 {
		return nil, fmt.Errorf("%w: ring of %d slots of %d bytes", ErrInvalid, n, slotSize)
	}
	most = max(most, n)
	size := int64(n) * slotSize
	if err := share.acquire(ctx, size, wait, fmt.Sprintf("a dataset session's ring (%d slots × %d bytes)", n, slotSize)); err != nil {
		if errors.Is(err, ErrOverBudget) && size <= share.size {
			// It could fit once others close: say how many sessions fit at
			// once, which a DataLoader's worker count easily passes.
			err = fmt.Errorf("%w; that share holds %d such rings, one per open session, and every DataLoader worker "+
				"of every rank on this node opens its own", err, share.size/size)
		}
		err = budget.Wrap(err, budget.RingSlots, budget.SlotBytes)
		return nil, err
	}
	r := &Ring{a: a, budget: share, wait: wait, slotSize: slotSize, base: n, free: make(chan Region, most), turns: make(chan struct{}, most)}
	for range most - n {
		r.turns <- struct{}{}
	}
	actx, cancel, _ := roomWait(ctx, wait)
	defer cancel()
	for range n {
		reg, err := a.Alloc(actx, slotSize)
		if err != nil {
			r.budget.release(int64(n-len(r.slots)) * slotSize)
			r.Close()
			return nil, fmt.Errorf("ring slot: %w", err)
		}
		r.add(reg)
	}
	return r, nil
}

// add puts a new slot in the ring. Call with mu, or before the ring is shared.
func (r *Ring) add(reg Region) {
	r.slots = append(r.slots, reg)
	r.size.Add(1)
	r.free <- reg
}

// Slots is the number of slots the ring has now.
func (r *Ring) Slots() int { return int(r.size.Load()) }

// Max is the number of slots the ring may grow to.
func (r *Ring) Max() int { return cap(r.free) }

// Grow adds a slot if the ring is below its maximum and the datasets'
// share of the arena has room for it beside a whole starting ring; it
// never waits for room. It reports whether the ring grew.
func (r *Ring) Grow() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || len(r.slots) >= cap(r.free) || !r.budget.tryAcquire(r.slotSize, int64(r.base)*r.slotSize) {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), growAllocWait)
	defer cancel()
	reg, err := r.a.Alloc(ctx, r.slotSize)
	if err != nil {
		r.budget.release(r.slotSize)
		return false
	}
	r.add(reg)
	<-r.turns // one growth token: a turn more
	return true
}

// growAllocWait bounds Grow's wait for the arena to find room the budget
// says is there (taken by saves, beyond the datasets' share of it).
const growAllocWait = 10 * time.Millisecond

// Fill copies a batch into a free slot or, if it does not fit one, into a
// region of its own, waiting for a turn (a delivery released) first;
// waitSlot is called before it waits.
func (r *Ring) Fill(ctx context.Context, b *Batch, waitSlot func()) (*Delivery, error) {
	select {
	case r.turns <- struct{}{}:
	default:
		waitSlot()
		select {
		case r.turns <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	d, err := r.fill(ctx, b)
	if err != nil {
		<-r.turns
	}
	return d, err
}

func (r *Ring) fill(ctx context.Context, b *Batch) (*Delivery, error) {
	size := batchSize(b)
	d := &Delivery{Position: b.Position, Samples: make([]SampleRef, len(b.Samples))}
	if size <= r.slotSize {
		d.Region, d.slot = <-r.free, true // a turn leaves a slot free: each delivery holds one turn, at most one slot
	} else {
		what := fmt.Sprintf("a batch of %d bytes (larger than a %d-byte slot)", size, r.slotSize)
		if err := r.budget.acquire(ctx, size, r.wait, what); err != nil {
			return nil, budget.Wrap(err, budget.SlotBytes)
		}
		actx, cancel := context.WithTimeout(ctx, r.wait)
		defer cancel()
		reg, err := r.a.Alloc(actx, size)
		if err != nil {
			r.budget.release(size)
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		d.Region = reg
	}
	// Samples may alias a mapped shard whose file can shrink under it.
	if err := readMapped(func() error { r.copy(b, d); return nil }); err != nil {
		r.giveBack(d)
		return nil, err
	}
	return d, nil
}

func batchSize(b *Batch) int64 {
	var n int64
	for i := range b.Samples {
		n += b.Samples[i].Size()
	}
	return n
}

// copy lays the batch's fields out back to back in the region.
func (r *Ring) copy(b *Batch, d *Delivery) {
	mem := r.a.Bytes()[d.Region.Offset : d.Region.Offset+d.Region.Length]
	var off int64
	for i, s := range b.Samples {
		ref := SampleRef{Key: s.Key, Fields: make([]FieldRef, len(s.Fields))}
		for j, f := range s.Fields {
			n := int64(copy(mem[off:], f.Data))
			ref.Fields[j] = FieldRef{Name: f.Name, Offset: off, Length: n}
			off += n
		}
		d.Samples[i] = ref
	}
}

// Release gives a delivery's region and turn back.
func (r *Ring) Release(d *Delivery) {
	r.giveBack(d)
	<-r.turns
}

// giveBack returns a delivery's region: its slot, or its own region.
func (r *Ring) giveBack(d *Delivery) {
	if d.slot {
		r.free <- d.Region
	} else {
		_ = r.a.Free(d.Region)
		r.budget.release(d.Region.Length)
	}
}

// Close frees every slot and gives them back to the budget; deliveries
// still held are invalid after it.
func (r *Ring) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.closed = true
	for _, reg := range r.slots {
		_ = r.a.Free(reg)
	}
	r.budget.release(int64(len(r.slots)) * r.slotSize)
	r.slots = nil
}
