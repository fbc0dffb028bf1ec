package checkpoint

import (
	"fmt"
	"runtime"
	"sort"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/checkpoint/codec"
)

// Shards held in memory. The daemon's memory tiers keep a shard as its
// data space (the bytes a restore hands out: the tensors packed back to
// back, raw) with a manifest whose chunk hashes verify it whenever it is
// served, exactly as a shard read back from storage is verified.

// MemoryManifest describes a shard kept in memory: its chunks as the
// writer would cut them, stored raw at their data-space offsets in the
// data object a persisted save would have, each with its hash, so that it
// is served and sent to peers verified like any other.
func MemoryManifest(t Target, layout *Layout, metadata, data []byte, chunkSize int64) *Manifest {
	return memoryManifest(t, layout, metadata, data, layout.planChunks(chunkSize, 0))
}

// CheckedMemoryManifest is MemoryManifest with chunks cut at check's ends,
// failing (ErrStagedChanged) unless data, the daemon's own copy of the
// staged bytes, has the MACs its client took as it copied them.
func CheckedMemoryManifest(t Target, layout *Layout, metadata, data []byte, check *CopyCheck) (*Manifest, error) {
	if err := check.Validate(layout, true); err != nil {
		return nil, err
	}
	m := memoryManifest(t, layout, metadata, data, layout.planEnds(check.Ends))
	macs, err := Sums(check.Key, check.Ends, data)
	if err == nil {
		err = check.verify(macs)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", t, err)
	}
	return m, nil
}

func memoryManifest(t Target, layout *Layout, metadata, data []byte, plan []chunkPlan) *Manifest {
	m := &Manifest{
		Format: ManifestFormat, Version: ManifestVersion,
		Job: t.Job, Step: t.Step, Rank: t.Rank, WorldSize: t.WorldSize, Attempt: t.Attempt,
		Created: time.Now().UTC(), DataSize: layout.DataSize, StoredSize: layout.DataSize,
		Tensors: layout.Packed, Metadata: metadata, Chunks: make([]Chunk, len(plan)),
	}
	obj := t.dataObject()
	counts := make([][]tensorCount, len(plan))
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i, p := range plan {
		g.Go(func() error {
			raw := data[p.rawOffset : p.rawOffset+p.raw]
			m.Chunks[i] = Chunk{Object: obj, Offset: p.rawOffset, Stored: p.raw, RawOffset: p.rawOffset, Raw: p.raw,
				Codec: codec.None, Hash: codec.HashString(raw)}
			counts[i] = countChunk(p, raw, layout.Packed)
			return nil
		})
	}
	_ = g.Wait()
	var nonFinite []int64
	for _, cs := range counts {
		for _, tc := range cs {
			if nonFinite == nil {
				nonFinite = make([]int64, len(layout.Packed))
			}
			nonFinite[tc.tensor] += tc.n
		}
	}
	m.setNonFinite(nonFinite)
	return m
}

// VerifyChunk checks chunk i of m in data, m's data space held in memory
// (whose copy it is, where says, for the error); with dst it copies the
// chunk there as it hashes it (one pass over memory).
func (m *Manifest) VerifyChunk(i int, data, dst []byte, where string) error {
	c := m.Chunks[i]
	if c.RawOffset < 0 || c.Raw < 0 || c.RawOffset > int64(len(data))-c.Raw {
		return fmt.Errorf("%w: %s of step %d rank %d: chunk %d outside its data", ErrCorrupt, where, m.Step, m.Rank, i)
	}
	raw := data[c.RawOffset : c.RawOffset+c.Raw]
	var h uint64
	if dst != nil {
		h = codec.CopyHash(dst[c.RawOffset:c.RawOffset+c.Raw], raw)
	} else {
		h = codec.Hash(raw)
	}
	if got := codec.FormatHash(h); got != c.Hash {
		return fmt.Errorf("%w: %s of step %d rank %d: chunk %d hash %s, want %s", ErrCorrupt, where, m.Step, m.Rank, i, got, c.Hash)
	}
	return nil
}

// CopyVerified copies data, m's data space, into dst chunk by chunk, on
// every CPU, checking each chunk against its hash as it copies it (one
// pass over memory). dst holds garbage when it fails.
func (m *Manifest) CopyVerified(data, dst []byte, where string) error {
	if len(dst) < len(data) {
		return fmt.Errorf("%w: %s of step %d rank %d: a region of %d bytes for %d", ErrCorrupt, where, m.Step, m.Rank, len(dst), len(data))
	}
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i := range m.Chunks {
		g.Go(func() error { return m.VerifyChunk(i, data, dst, where) })
	}
	return g.Wait()
}

// CopySelected copies sel's tensors out of data, m's data space, into
// dst, checking every chunk they touch against its hash.
func (m *Manifest) CopySelected(data []byte, sel Selection, dst []byte, where string) error {
	if err := m.VerifySelected(data, sel, where); err != nil {
		return err
	}
	for _, p := range sel.parts {
		copy(dst[p.dst:p.dst+p.n], data[p.src:p.src+p.n])
	}
	return nil
}

// VerifySelected checks every chunk of data, m's data space held in
// memory, that sel touches (every chunk when whole) against its hash, on
// every CPU, copying nothing: for a restore that hands data out as it is.
func (m *Manifest) VerifySelected(data []byte, sel Selection, where string) error {
	touched := func(c Chunk) bool { return true }
	if !sel.Whole {
		rs := sel.ranges()
		touched = func(c Chunk) bool { // rs is sorted and its ranges apart
			j := sort.Search(len(rs), func(j int) bool { return rs[j].off+rs[j].n > c.RawOffset })
			return j < len(rs) && rs[j].off < c.RawOffset+c.Raw
		}
	}
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i, c := range m.Chunks {
		if touched(c) {
			g.Go(func() error { return m.VerifyChunk(i, data, nil, where) })
		}
	}
	return g.Wait()
}

// VerifyArriving checks m's chunks in dst in order, each once arrived
// says the bytes up to its end are there (a transfer's progress); it
// drains arrived to its end whatever it finds.
func (m *Manifest) VerifyArriving(dst []byte, arrived <-chan int64, where string) error {
	defer func() {
		for range arrived {
		}
	}()
	var have int64
	for i, c := range m.Chunks {
		for end := c.RawOffset + c.Raw; have < end && end <= int64(len(dst)); {
			n, ok := <-arrived
			if !ok {
				return nil // the transfer ended early: its error says why
			}
			have = n
		}
		if err := m.VerifyChunk(i, dst, nil, where); err != nil {
			return err
		}
	}
	return nil
}
