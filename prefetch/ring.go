package prefetch

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ckptd/ckptd/internal/arena"
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
	Region   arena.Region
	Samples  []SampleRef
	Position int64
	slot     bool // a ring slot (else a one-off region for an oversized batch)
}

// Ring is a fixed set of equal slots in the shared-memory arena that
// batches are copied into for the trainer to read: pre-faulted and locked
// with the arena, and registrable once with CUDA like the rest of it. A
// batch larger than a slot gets a region of its own, freed on release, so
// that oversized samples are still delivered.
type Ring struct {
	a        *arena.Arena
	slotSize int64
	free     chan arena.Region

	mu    sync.Mutex
	slots []arena.Region // all, for Close
}

// oversizeWait bounds the wait for arena space for an oversized batch.
const oversizeWait = 30 * time.Second

// NewRing allocates n slots of slotSize bytes from a.
func NewRing(ctx context.Context, a *arena.Arena, n int, slotSize int64) (*Ring, error) {
	if n <= 0 || slotSize <= 0 {
		return nil, fmt.Errorf("%w: ring of %d slots of %d bytes", ErrInvalid, n, slotSize)
	}
	r := &Ring{a: a, slotSize: slotSize, free: make(chan arena.Region, n)}
	for range n {
		reg, err := a.Alloc(ctx, slotSize)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("ring slot: %w", err)
		}
		r.slots = append(r.slots, reg)
		r.free <- reg
	}
	return r, nil
}

// Fill copies a batch into a free slot (waiting for one) or, if it does not
// fit, into a region of its own.
func (r *Ring) Fill(ctx context.Context, b *Batch, waitSlot func()) (*Delivery, error) {
	size := batchSize(b)
	d := &Delivery{Position: b.Position, Samples: make([]SampleRef, len(b.Samples))}
	if size <= r.slotSize {
		waitSlot()
		select {
		case d.Region = <-r.free:
			d.slot = true
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	} else {
		actx, cancel := context.WithTimeout(ctx, oversizeWait)
		defer cancel()
		reg, err := r.a.Alloc(actx, size)
		if err != nil {
			return nil, fmt.Errorf("batch of %d bytes (larger than a %d-byte slot): %w", size, r.slotSize, err)
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

// Release gives a delivery's region back.
func (r *Ring) Release(d *Delivery) {
	if d.slot {
		r.free <- d.Region
		return
	}
	_ = r.a.Free(d.Region)
}

// Close frees every slot; deliveries still held are invalid after it.
func (r *Ring) Close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, reg := range r.slots {
		_ = r.a.Free(reg)
	}
	r.slots = nil
}
