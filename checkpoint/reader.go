package checkpoint

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"unsafe"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/storage"
)

// Sink receives a shard's data-space bytes during a restore. WriteAt is
// called concurrently for disjoint ranges.
type Sink interface {
	WriteAt(p []byte, off int64) (int, error)
}

// BufferSink restores into memory (an arena region): chunks decompress
// straight into it, with no intermediate copy.
type BufferSink []byte

// WriteAt copies p into the buffer (used only when decoding could not
// write in place).
func (b BufferSink) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(b)) {
		return 0, fmt.Errorf("write [%d, %d) outside a %d-byte buffer", off, off+int64(len(p)), len(b))
	}
	return copy(b[off:], p), nil
}

// ReadOptions tune a restore or verify.
type ReadOptions struct {
	// Concurrency is how many reads run at once (default 8).
	Concurrency int
	// SpanBytes is how many stored bytes of adjacent chunks one read
	// fetches (default 16 MiB): object stores answer a few large ranged
	// GETs much faster than many chunk-sized ones. Memory is at most
	// Concurrency × (a chunk's stored + raw size), whatever the span.
	SpanBytes int64
	// Progress, if set, is called with the raw bytes of each chunk done.
	Progress func(n int64)
}

// ReadShard fetches every chunk of m, verifies its hash and writes the raw
// bytes to sink (nil: verify only). A chunk that is missing, truncated,
// fails to decode or mismatches its hash yields an ErrCorrupt error naming
// the step, rank and chunk.
func (s *Store) ReadShard(ctx context.Context, m *Manifest, sink Sink, opts ReadOptions) error {
	return s.readChunks(ctx, m, []readRange{{0, len(m.Chunks)}}, sink, opts)
}

// ReadRange is ReadShard for the chunks that hold data-space bytes [off,
// off+n) (a tensor's, say): they are fetched and verified, and each is
// written whole to sink at its data-space offset, so sink also receives
// the bytes of other tensors that share those chunks.
func (s *Store) ReadRange(ctx context.Context, m *Manifest, off, n int64, sink Sink, opts ReadOptions) error {
	if off < 0 || n < 0 || off > m.DataSize || n > m.DataSize-off {
		return fmt.Errorf("%w: range [%d, +%d) outside the shard's %d bytes", ErrInvalid, off, n, m.DataSize)
	}
	return s.readChunks(ctx, m, []readRange{chunksOf(m, off, n)}, sink, opts)
}

// chunksOf returns the chunks of m that hold data-space bytes [off, off+n).
func chunksOf(m *Manifest, off, n int64) readRange {
	first, _ := slices.BinarySearchFunc(m.Chunks, off, func(c Chunk, off int64) int {
		return cmp.Compare(c.RawOffset+c.Raw, off+1) // the first chunk ending past off
	})
	last := first
	for last < len(m.Chunks) && m.Chunks[last].RawOffset < off+n {
		last++
	}
	return readRange{first, last}
}

// ReadTensor returns the bytes of one of m's tensors, reading and
// verifying only the chunks that hold them.
func (s *Store) ReadTensor(ctx context.Context, m *Manifest, t Tensor, opts ReadOptions) ([]byte, error) {
	out := make([]byte, t.Length)
	sink := &scatterSink{parts: []part{{src: t.Offset, n: t.Length}}, dst: out}
	if err := s.ReadRange(ctx, m, t.Offset, t.Length, sink, opts); err != nil {
		return nil, err
	}
	return out, nil
}

// readChunks reads the chunks of m that spans name (sorted, disjoint), all
// of them concurrently.
func (s *Store) readChunks(ctx context.Context, m *Manifest, spans []readRange, sink Sink, opts ReadOptions) error {
	if opts.Concurrency <= 0 {
		opts.Concurrency = 8
	}
	if opts.SpanBytes <= 0 {
		opts.SpanBytes = 16 << 20
	}
	if b, ok := sink.(BufferSink); ok && int64(len(b)) < m.DataSize {
		return fmt.Errorf("restore buffer of %d bytes is smaller than the shard's %d", len(b), m.DataSize)
	}
	var pool sync.Pool
	var reads []readRange
	for _, span := range spans {
		for _, sp := range readRanges(m.Chunks[span.first:span.last], opts.SpanBytes) {
			reads = append(reads, readRange{sp.first + span.first, sp.last + span.first})
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.Concurrency)
	for _, sp := range reads {
		if gctx.Err() != nil {
			break
		}
		g.Go(func() error {
			buf, _ := pool.Get().(*[]byte)
			if buf == nil {
				buf = new([]byte)
			}
			defer pool.Put(buf)
			return s.readSpan(gctx, m, sp, sink, buf, opts.Progress)
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return ctx.Err()
}

// readRange is chunks [first, last) stored back to back in one object.
type readRange struct{ first, last int }

// readRanges groups adjacent chunks into reads of at most max stored bytes (a
// larger chunk is a read of its own).
func readRanges(cs []Chunk, max int64) []readRange {
	var out []readRange
	for i := 0; i < len(cs); {
		j, n := i+1, cs[i].Stored
		for j < len(cs) && cs[j].Object == cs[i].Object && cs[j].Offset == cs[j-1].Offset+cs[j-1].Stored && n+cs[j].Stored <= max {
			n += cs[j].Stored
			j++
		}
		out = append(out, readRange{i, j})
		i = j
	}
	return out
}

// readSpan fetches a span with one ranged read and handles its chunks in
// order as they stream in.
func (s *Store) readSpan(ctx context.Context, m *Manifest, sp readRange, sink Sink, buf *[]byte, progress func(int64)) error {
	first, last := m.Chunks[sp.first], m.Chunks[sp.last-1]
	rc, err := s.backend.Get(ctx, inJob(s.job, first.Object), first.Offset, last.Offset+last.Stored-first.Offset)
	if err != nil {
		return s.chunkErr(m, sp.first, err)
	}
	defer rc.Close()
	for i := sp.first; i < sp.last; i++ {
		if err := s.readChunk(m, i, rc, sink, buf); err != nil {
			return err
		}
		if progress != nil {
			progress(m.Chunks[i].Raw)
		}
	}
	return nil
}

// chunkErr names the chunk an error is about. Cancellation passes
// through; a store that cannot be reached or is full stays that (the
// restore may work later, nothing is wrong with the data); anything else
// (a missing or short object, a failed decode) means the data is corrupt.
func (s *Store) chunkErr(m *Manifest, i int, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	c := m.Chunks[i]
	return &ChunkError{Step: m.Step, Rank: m.Rank, Chunk: i, Object: c.Object, Offset: c.Offset, Err: err}
}

// ChunkError is a failure to read one chunk of a committed shard. It
// matches ErrCorrupt (a missing object included: the commit record names
// it) unless the storage was unavailable or full, which it then wraps.
type ChunkError struct {
	Step   int64
	Rank   int
	Chunk  int
	Object string // relative to the job folder
	Offset int64
	Err    error
}

// corrupt reports whether the chunk's data is at fault, not the store.
func (e *ChunkError) corrupt() bool {
	return !errors.Is(e.Err, storage.ErrUnavailable) && !errors.Is(e.Err, storage.ErrNoSpace)
}

func (e *ChunkError) Error() string {
	what := "corrupt checkpoint data: "
	if !e.corrupt() {
		what = ""
	}
	return fmt.Sprintf("%sstep %d rank %d chunk %d (%s at %d): %v", what, e.Step, e.Rank, e.Chunk, e.Object, e.Offset, e.Err)
}

func (e *ChunkError) Unwrap() error { return e.Err }

// Is makes a ChunkError about the data match ErrCorrupt.
func (e *ChunkError) Is(target error) bool { return target == ErrCorrupt && e.corrupt() }

// inPlace is a Sink that can take a chunk's bytes where they belong, so
// that the chunk is read and decoded straight into them.
type inPlace interface {
	Sink
	// target returns where data-space bytes [off, off+n) go, or nil
	// when they do not go to one place.
	target(off, n int64) []byte
}

func (b BufferSink) target(off, n int64) []byte {
	if off < 0 || n < 0 || off+n > int64(len(b)) {
		return nil
	}
	return b[off : off+n]
}

// readChunk reads chunk i's stored bytes from r, decodes and verifies them,
// and hands them to sink. buf is scratch space.
func (s *Store) readChunk(m *Manifest, i int, r io.Reader, sink Sink, buf *[]byte) error {
	c := m.Chunks[i]
	var direct []byte
	if p, ok := sink.(inPlace); ok {
		direct = p.target(c.RawOffset, c.Raw)
	}
	stored, dst := s.buffers(c, direct, buf)
	if _, err := io.ReadFull(r, stored); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			err = fmt.Errorf("object truncated: want %d bytes", len(stored))
		}
		return s.chunkErr(m, i, err)
	}
	raw := stored
	if c.Codec != codec.None {
		var err error
		if raw, err = codec.Decode(c.Codec, dst, stored, int(c.Raw)); err != nil {
			return s.chunkErr(m, i, err)
		}
	}
	want, _ := codec.ParseHash(c.Hash) // validated with the manifest
	if got := codec.Hash(raw); got != want {
		return s.chunkErr(m, i, fmt.Errorf("hash %s, manifest says %s", codec.FormatHash(got), c.Hash))
	}
	if sink == nil || direct != nil && sameStart(raw, direct) {
		return nil
	}
	_, err := sink.WriteAt(raw, c.RawOffset)
	return err
}

// buffers picks where chunk c's stored bytes are read to and where they
// decode to: straight into direct, the chunk's place in the sink, when
// it has one, else into scratch space in *buf.
func (s *Store) buffers(c Chunk, direct []byte, buf *[]byte) (stored, dst []byte) {
	switch {
	case direct != nil && c.Codec == codec.None:
		return direct, nil
	case direct != nil:
		return grow(buf, int(c.Stored)), direct[:0:len(direct)]
	}
	all := grow(buf, int(c.Stored+c.Raw))
	return all[:c.Stored], all[c.Stored:c.Stored:len(all)]
}

func grow(buf *[]byte, n int) []byte {
	if cap(*buf) < n {
		*buf = make([]byte, n)
	}
	return (*buf)[:n]
}

func sameStart(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}
