package prefetch

import (
	"context"
	"fmt"
	"sync"
	"time"
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
	slot     bool // a ring slot (else a one-off region for an oversized batch)
}

// Ring is a fixed set of equal slots in the shared-memory arena that
// batches are copied into for the trainer to read: pre-faulted and locked
// with the arena, and registrable once with CUDA like the rest of it. A
// batch larger than a slot gets a region of its own, freed on release, so
// that oversized samples are still delivered; it takes one of the ring's
// turns like a slot, so a session never has more deliveries out than its
// ring has slots. Slots and oversized regions are charged to the
// datasets' share of the arena.
type Ring struct {
	a        Arena
	budget   *arenaBudget
	wait     time.Duration // for arena space for an oversized batch
	slotSize int64
	free     chan Region
	turns    chan struct{} // one per delivery not released

	mu     sync.Mutex
	slots  []Region // all, for Close
	closed bool
}

// newRing charges n slots of slotSize bytes to budget and allocates them
// from a, waiting up to wait for room (for an oversized batch too).
func newRing(ctx context.Context, a Arena, budget *arenaBudget, n int, slotSize int64, wait time.Duration) (*Ring, error) {
	if n <= 0 || slotSize <= 0 {
		return nil, fmt.Errorf("%w: ring of %d slots of %d bytes", ErrInvalid, n, slotSize)
	}
	size := int64(n) * slotSize
	if err := budget.acquire(ctx, size, wait, fmt.Sprintf("a dataset session's ring (--ring-slots %d × --slot-bytes %d)", n, slotSize)); err != nil {
		return nil, err
	}
	r := &Ring{a: a, budget: budget, wait: wait, slotSize: slotSize, free: make(chan Region, n), turns: make(chan struct{}, n)}
	actx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for range n {
		reg, err := a.Alloc(actx, slotSize)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("ring slot: %w", err)
		}
		r.slots = append(r.slots, reg)
		r.free <- reg
	}
	return r, nil
}

// Fill copies a batch into a free slot or, if it does not fit one, into a
// region of its own, waiting for a turn (a delivery released) first.
func (r *Ring) Fill(ctx context.Context, b *Batch, waitSlot func()) (*Delivery, error) {
	waitSlot()
	select {
	case r.turns <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
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
		what := fmt.Sprintf("a batch of %d bytes (larger than a %d-byte --slot-bytes slot)", size, r.slotSize)
		if err := r.budget.acquire(ctx, size, r.wait, what); err != nil {
			return nil, err
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
	r.copy(b, d)
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
	if d.slot {
		r.free <- d.Region
	} else {
		_ = r.a.Free(d.Region)
		r.budget.release(d.Region.Length)
	}
	<-r.turns
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
	r.slots = nil
	r.budget.release(int64(cap(r.free)) * r.slotSize)
}
