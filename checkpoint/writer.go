package checkpoint

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"runtime"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/internal/codec"
	"github.com/ckptd/ckptd/storage"
)

// WriterOptions configure how shards are cut and compressed.
type WriterOptions struct {
	// ChunkSize is the raw size of a chunk (default 4 MiB; a multiple of 8,
	// at most MaxChunkSize).
	ChunkSize int64
	// Codec compresses every chunk; a chunk that does not shrink is stored
	// raw whatever the codec.
	Codec codec.Codec
	// Workers is how many chunks are compressed at once across all shards
	// (default GOMAXPROCS).
	Workers int
	// InFlight is how many chunks may be compressed or waiting to be
	// written at once across all shards (default 2 × Workers).
	InFlight int
}

func (o *WriterOptions) setDefaults() error {
	if o.ChunkSize == 0 {
		o.ChunkSize = 4 << 20
	}
	if o.ChunkSize%8 != 0 || o.ChunkSize < 4096 || o.ChunkSize > MaxChunkSize {
		return fmt.Errorf("%w: chunk size %d must be a multiple of 8 in [4096, %d]", ErrInvalid, o.ChunkSize, MaxChunkSize)
	}
	if o.Codec == "" {
		o.Codec = codec.Zstd
	}
	if _, err := codec.Parse(string(o.Codec)); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if o.Workers <= 0 {
		o.Workers = runtime.GOMAXPROCS(0)
	}
	if o.InFlight < o.Workers {
		o.InFlight = 4 * o.Workers
	}
	return nil
}

// Writer drains staged shards to a backend. One Writer serves every shard
// the daemon drains, so its bounds hold across concurrent drains: memory
// for chunks is at most InFlight × (ChunkSize + codec bound), preallocated
// lazily in a fixed pool, and at most Workers chunks compress at once.
type Writer struct {
	b    storage.Backend
	opts WriterOptions
	bufs chan *chunkBuf   // the pool; a drain blocks when it is empty
	cpu  chan struct{}    // compression slots
	now  func() time.Time // for tests
}

type chunkBuf struct{ gather, enc []byte }

// NewWriter makes a Writer for backend b.
func NewWriter(b storage.Backend, opts WriterOptions) (*Writer, error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	w := &Writer{
		b: b, opts: opts,
		bufs: make(chan *chunkBuf, opts.InFlight),
		cpu:  make(chan struct{}, opts.Workers),
		now:  time.Now,
	}
	for range opts.InFlight {
		w.bufs <- &chunkBuf{}
	}
	return w, nil
}

// Options returns the effective options.
func (w *Writer) Options() WriterOptions { return w.opts }

// Shard is one rank's staged data.
type Shard struct {
	Target   Target
	Layout   *Layout
	Data     []byte // the staging region; Layout.Region offsets index it
	Metadata []byte
}

// WriteShard makes a shard durable: its chunks, then its manifest. It does
// not commit the step (see TryCommit). Data is only read.
func (w *Writer) WriteShard(ctx context.Context, sh *Shard) (*Manifest, error) {
	if err := sh.Layout.CheckRegion(int64(len(sh.Data))); err != nil {
		return nil, err
	}
	t := sh.Target
	m := &Manifest{
		Format: ManifestFormat, Version: ManifestVersion,
		Job: t.Job, Step: t.Step, Rank: t.Rank, WorldSize: t.WorldSize,
		Created: w.now().UTC(), DataSize: sh.Layout.DataSize,
		Tensors: sh.Layout.Packed, Metadata: sh.Metadata,
	}
	if plan := planChunks(sh.Layout, w.opts.ChunkSize); len(plan) > 0 {
		obj := dataObject(t.Step, t.Rank)
		chunks, err := w.writeData(ctx, t.Job, obj, sh.Data, plan)
		if err != nil {
			return nil, fmt.Errorf("write %s data: %w", t, err)
		}
		m.Chunks = chunks
		for _, c := range chunks {
			m.StoredSize += c.Stored
		}
	}
	b, err := m.Encode()
	if err != nil {
		return nil, err
	}
	name := manifestName(t.Job, t.Step, t.Rank)
	if err := w.b.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
		return nil, fmt.Errorf("write %s manifest: %w", t, err)
	}
	return m, nil
}

// pending is a chunk being compressed; done receives once it is ready.
type pending struct {
	plan  chunkPlan
	buf   *chunkBuf
	chunk Chunk
	out   []byte // stored bytes: a slice of data or of buf
	done  chan struct{}
}

// writeData compresses chunks in parallel and streams them, in order, into
// one object. Chunks compress out of order but are written in order, so the
// object's layout matches the manifest and the backend sees a plain stream.
func (w *Writer) writeData(ctx context.Context, job, obj string, data []byte, plan []chunkPlan) ([]Chunk, error) {
	g, gctx := errgroup.WithContext(ctx)
	pr, pw := io.Pipe()
	queue := make(chan *pending, cap(w.bufs))
	g.Go(func() error {
		err := w.b.Put(gctx, inJob(job, obj), pr, -1)
		pr.CloseWithError(err) // unblock the consumer if Put gave up early
		return err
	})
	g.Go(func() error { return w.produce(gctx, data, plan, queue) })
	chunks := make([]Chunk, 0, len(plan))
	g.Go(func() error {
		var offset int64
		err := w.consume(queue, func(p *pending) error {
			p.chunk.Object, p.chunk.Offset = obj, offset
			offset += p.chunk.Stored
			chunks = append(chunks, p.chunk)
			_, err := pw.Write(p.out)
			return err
		})
		pw.CloseWithError(err) // nil: end of stream, the Put may commit
		return err
	})
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return chunks, nil
}

// produce starts one compression per chunk, in order, as buffers and CPU
// slots allow, and queues them for the consumer. It closes queue on return.
func (w *Writer) produce(ctx context.Context, data []byte, plan []chunkPlan, queue chan<- *pending) error {
	defer close(queue)
	for _, cp := range plan {
		var buf *chunkBuf
		select {
		case buf = <-w.bufs:
		case <-ctx.Done():
			return ctx.Err()
		}
		p := &pending{plan: cp, buf: buf, done: make(chan struct{})}
		queue <- p // never blocks: queue holds as many as there are buffers
		w.cpu <- struct{}{}
		go func() {
			defer func() { <-w.cpu; close(p.done) }()
			w.encode(data, p)
		}()
	}
	return nil
}

// consume writes finished chunks in order. After the first error it keeps
// draining the queue so that every buffer returns to the pool.
func (w *Writer) consume(queue <-chan *pending, write func(*pending) error) error {
	var err error
	for p := range queue {
		<-p.done
		if err == nil {
			err = write(p)
		}
		w.bufs <- p.buf
	}
	return err
}

// encode hashes and compresses one chunk into p.out; a chunk that does not
// shrink is stored raw.
func (w *Writer) encode(data []byte, p *pending) {
	raw := gather(data, p.plan, &p.buf.gather)
	c := Chunk{RawOffset: p.plan.rawOffset, Raw: p.plan.raw, Hash: codec.FormatHash(codec.Hash(raw))}
	p.out, c.Codec = raw, codec.None
	if w.opts.Codec != codec.None {
		enc, err := codec.Encode(w.opts.Codec, p.buf.enc, raw)
		if err == nil && len(enc) < len(raw) {
			p.buf.enc, p.out, c.Codec = enc, enc, w.opts.Codec
		}
	}
	c.Stored = int64(len(p.out))
	p.chunk = c
}

// gather returns the chunk's bytes: a slice of data when they are
// contiguous (the usual case), else a copy into *buf.
func gather(data []byte, cp chunkPlan, buf *[]byte) []byte {
	if len(cp.spans) == 1 {
		s := cp.spans[0]
		return data[s.off : s.off+s.n]
	}
	b := (*buf)[:0]
	for _, s := range cp.spans {
		b = append(b, data[s.off:s.off+s.n]...)
	}
	*buf = b
	return b
}
