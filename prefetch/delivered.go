package prefetch

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"slices"
)

// Delivered is a position in an epoch that survives a change of world
// size: the samples already delivered, by shard, as a bitmap over each
// shard's samples in file order. Every rank's iteration can say what it
// delivered up to a position (Iterator.Delivered); the union of all ranks'
// is the epoch's, and an iteration opened with it (Spec.Delivered), at any
// world size, delivers exactly the samples not in it, each once across the
// ranks.
//
// Encoded (Encode, DecodeDelivered) it is opaque bytes that trainers store
// in their checkpoints:
//
//	"ckd1", uvarint entries, then per entry: uvarint name length, name,
//	uvarint total (the shard's sample count; 0 when not yet known),
//	uvarint bitmap bytes, bitmap (bit i of byte i/8, low bit first).
type Delivered struct {
	shards map[string]*shardBits
}

type shardBits struct {
	total int // samples in the shard; 0 while unknown
	bits  []byte
}

// Limits on what DecodeDelivered accepts.
const (
	maxDeliveredShards  = 1 << 22
	maxSamplesPerShard  = 1 << 24
	deliveredMagic      = "ckd1"
	maxDeliveredEncoded = 256 << 20
)

// NewDelivered returns an empty set.
func NewDelivered() *Delivered { return &Delivered{shards: map[string]*shardBits{}} }

func (d *Delivered) entry(shard string) *shardBits {
	e := d.shards[shard]
	if e == nil {
		e = &shardBits{}
		d.shards[shard] = e
	}
	return e
}

// add marks sample ord of shard delivered.
func (d *Delivered) add(shard string, ord int) {
	e := d.entry(shard)
	if n := ord/8 + 1; n > len(e.bits) {
		e.bits = append(e.bits, make([]byte, n-len(e.bits))...)
	}
	e.bits[ord/8] |= 1 << (ord % 8)
}

// setTotal records how many samples shard has.
func (d *Delivered) setTotal(shard string, total int) { d.entry(shard).total = total }

// Has reports whether sample ord of shard was delivered.
func (d *Delivered) Has(shard string, ord int) bool {
	e := d.shards[shard]
	return e != nil && ord/8 < len(e.bits) && e.bits[ord/8]&(1<<(ord%8)) != 0
}

// countBelow is how many of the first n samples of shard d holds (0 for
// a nil d).
func (d *Delivered) countBelow(shard string, n int) int {
	if d == nil {
		return 0
	}
	e := d.shards[shard]
	if e == nil {
		return 0
	}
	c := 0
	for i, b := range e.bits {
		if i*8 >= n {
			break
		}
		if rest := n - i*8; rest < 8 {
			b &= byte(1<<rest) - 1
		}
		c += bits.OnesCount8(b)
	}
	return c
}

// Done reports whether every sample of shard was delivered (its total
// known and all of them marked).
func (d *Delivered) Done(shard string) bool {
	e := d.shards[shard]
	if e == nil || e.total == 0 {
		return false
	}
	n := 0
	for _, b := range e.bits {
		n += bits.OnesCount8(b)
	}
	return n >= e.total
}

// Count is the number of samples in the set.
func (d *Delivered) Count() int64 {
	var n int64
	for _, e := range d.shards {
		for _, b := range e.bits {
			n += int64(bits.OnesCount8(b))
		}
	}
	return n
}

// Union adds o's samples to d.
func (d *Delivered) Union(o *Delivered) {
	for name, oe := range o.shards {
		e := d.entry(name)
		e.total = max(e.total, oe.total)
		if len(oe.bits) > len(e.bits) {
			e.bits = append(e.bits, make([]byte, len(oe.bits)-len(e.bits))...)
		}
		for i, b := range oe.bits {
			e.bits[i] |= b
		}
	}
}

// Clone returns a copy of d.
func (d *Delivered) Clone() *Delivered {
	c := NewDelivered()
	c.Union(d)
	return c
}

// Encode returns d's bytes, shards in name order (so equal sets encode
// alike).
func (d *Delivered) Encode() []byte {
	names := make([]string, 0, len(d.shards))
	for n := range d.shards {
		names = append(names, n)
	}
	slices.Sort(names)
	b := []byte(deliveredMagic)
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, n := range names {
		e := d.shards[n]
		b = binary.AppendUvarint(b, uint64(len(n)))
		b = append(b, n...)
		b = binary.AppendUvarint(b, uint64(e.total))
		b = binary.AppendUvarint(b, uint64(len(e.bits)))
		b = append(b, e.bits...)
	}
	return b
}

// ErrBadPosition: an encoded position that is not one.
var ErrBadPosition = fmt.Errorf("%w: not a dataset position", ErrInvalid)

// DecodeDelivered parses Encode's bytes, which come from a trainer's
// checkpoint: untrusted, so every count is bounded.
func DecodeDelivered(b []byte) (*Delivered, error) {
	if len(b) > maxDeliveredEncoded {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", ErrBadPosition, len(b), maxDeliveredEncoded)
	}
	r := bytes.NewReader(b)
	magic := make([]byte, len(deliveredMagic))
	if _, err := io.ReadFull(r, magic); err != nil || string(magic) != deliveredMagic {
		return nil, fmt.Errorf("%w: no %q header", ErrBadPosition, deliveredMagic)
	}
	n, err := binary.ReadUvarint(r)
	if err != nil || n > maxDeliveredShards {
		return nil, fmt.Errorf("%w: shard count", ErrBadPosition)
	}
	d := NewDelivered()
	for range n {
		name, err := readBytes(r, 4096)
		if err != nil {
			return nil, fmt.Errorf("%w: shard name: %w", ErrBadPosition, err)
		}
		total, err := binary.ReadUvarint(r)
		if err != nil || total > maxSamplesPerShard {
			return nil, fmt.Errorf("%w: sample count of %q", ErrBadPosition, name)
		}
		bm, err := readBytes(r, maxSamplesPerShard/8)
		if err != nil {
			return nil, fmt.Errorf("%w: bitmap of %q: %w", ErrBadPosition, name, err)
		}
		e := d.entry(string(name))
		e.total = max(e.total, int(total))
		e.bits = append(e.bits[:0], bm...)
	}
	if r.Len() != 0 {
		return nil, fmt.Errorf("%w: %d bytes after the last shard", ErrBadPosition, r.Len())
	}
	return d, nil
}

// readBytes reads a uvarint length (at most max) and that many bytes.
func readBytes(r *bytes.Reader, max uint64) ([]byte, error) {
	n, err := binary.ReadUvarint(r)
	if err != nil {
		return nil, err
	}
	if n > max || n > uint64(r.Len()) {
		return nil, errors.New("length past the end or the limit")
	}
	b := make([]byte, n)
	_, err = io.ReadFull(r, b)
	return b, err
}
