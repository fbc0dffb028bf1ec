package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"unsafe"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/internal/codec"
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
	// Concurrency is how many chunks are fetched and decoded at once
	// (default 8). Memory is at most Concurrency × 2 chunks.
	Concurrency int
	// Progress, if set, is called with the raw bytes of each chunk done.
	Progress func(n int64)
}

// ReadShard fetches every chunk of m, verifies its hash and writes the raw
// bytes to sink (nil: verify only). A chunk that is missing, truncated,
// fails to decode or mismatches its hash yields an ErrCorrupt error naming
// the step, rank and chunk.
func (s *Store) ReadShard(ctx context.Context, m *Manifest, sink Sink, opts ReadOptions) error {
	if opts.Concurrency <= 0 {
		opts.Concurrency = 8
	}
	if b, ok := sink.(BufferSink); ok && int64(len(b)) < m.DataSize {
		return fmt.Errorf("restore buffer of %d bytes is smaller than the shard's %d", len(b), m.DataSize)
	}
	var pool sync.Pool
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.Concurrency)
	for i := range m.Chunks {
		if gctx.Err() != nil {
			break
		}
		g.Go(func() error {
			buf, _ := pool.Get().(*[]byte)
			if buf == nil {
				buf = new([]byte)
			}
			defer pool.Put(buf)
			if err := s.readChunk(gctx, m, i, sink, buf); err != nil {
				return err
			}
			if opts.Progress != nil {
				opts.Progress(m.Chunks[i].Raw)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return ctx.Err()
}

// readChunk fetches, decodes and verifies chunk i. buf is scratch space.
func (s *Store) readChunk(ctx context.Context, m *Manifest, i int, sink Sink, buf *[]byte) error {
	c := m.Chunks[i]
	fail := func(err error) error {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		return fmt.Errorf("%w: step %d rank %d chunk %d (%s at %d): %v", ErrCorrupt, m.Step, m.Rank, i, c.Object, c.Offset, err)
	}
	direct, _ := sink.(BufferSink)
	stored, dst := s.buffers(c, direct, buf)
	if err := s.fetch(ctx, c, stored); err != nil {
		return fail(err)
	}
	raw := stored
	if c.Codec != codec.None {
		var err error
		if raw, err = codec.Decode(c.Codec, dst, stored, int(c.Raw)); err != nil {
			return fail(err)
		}
	}
	want, _ := codec.ParseHash(c.Hash) // validated with the manifest
	if got := codec.Hash(raw); got != want {
		return fail(fmt.Errorf("hash %s, manifest says %s", codec.FormatHash(got), c.Hash))
	}
	if sink == nil || direct != nil && sameStart(raw, direct[c.RawOffset:]) {
		return nil
	}
	_, err := sink.WriteAt(raw, c.RawOffset)
	return err
}

// fetch reads exactly len(dst) stored bytes of chunk c.
func (s *Store) fetch(ctx context.Context, c Chunk, dst []byte) error {
	rc, err := s.B.Get(ctx, inJob(s.Job, c.Object), c.Offset, c.Stored)
	if err != nil {
		return err
	}
	defer rc.Close()
	if _, err := io.ReadFull(rc, dst); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return fmt.Errorf("object truncated: want %d bytes", len(dst))
		}
		return err
	}
	return nil
}

// buffers picks where chunk c's stored bytes are read to and where they
// decode to: straight into a memory sink when it has one, else into
// scratch space in *buf.
func (s *Store) buffers(c Chunk, direct BufferSink, buf *[]byte) (stored, dst []byte) {
	switch {
	case direct != nil && c.Codec == codec.None:
		return direct[c.RawOffset : c.RawOffset+c.Raw], nil
	case direct != nil:
		return grow(buf, int(c.Stored)), direct[c.RawOffset : c.RawOffset : c.RawOffset+c.Raw]
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
