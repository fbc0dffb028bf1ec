package checkpoint

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"runtime"
	"sync"
	"time"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/storage"
)

// WriterOptions configure how shards are cut and compressed.
type WriterOptions struct {
	// ChunkSize is the raw size of a chunk (default 4 MiB; a multiple of 8,
	// at most MaxChunkSize).
	ChunkSize int64
	// Codec compresses every chunk, or with codec.Auto (the default) is
	// picked per chunk from its dtype and the measured drain rates (see
	// codec.Selector). A chunk that does not shrink is stored raw whatever
	// the codec; the manifest records each chunk's codec.
	Codec codec.Codec
	// Workers is how many chunks are compressed at once across all shards
	// (default GOMAXPROCS).
	Workers int
	// InFlight is how many chunks may be compressed or waiting to be
	// written at once across all shards (default 4 × Workers).
	InFlight int
	// SpreadData writes each rank's data object under one of 256 folders
	// by a hash of the rank (spreadDataObject) instead of its step's
	// attempt folder, for S3's request rate per prefix at thousands of
	// ranks. Readers need no setting; prune, delete and the removal of a
	// refused save find the objects either way.
	SpreadData bool
	// Incremental writes each chunk's content key in the manifest
	// (version 4) and references, instead of writing, a chunk whose
	// content the rank's shard of the job's newest committed step holds
	// (see incremental.go). It costs a 128-bit hash of each chunk and a
	// few small requests per save.
	Incremental bool
}

// DefaultChunkSize is WriterOptions.ChunkSize's default (and --chunk-size's).
const DefaultChunkSize = 4 << 20

func (o *WriterOptions) setDefaults() error {
	if o.ChunkSize == 0 {
		o.ChunkSize = DefaultChunkSize
	}
	if o.ChunkSize%8 != 0 || o.ChunkSize < 4096 || o.ChunkSize > MaxChunkSize {
		return fmt.Errorf("%w: chunk size %d must be a multiple of 8 in [4096, %d]", ErrInvalid, o.ChunkSize, MaxChunkSize)
	}
	if o.Codec == "" {
		o.Codec = codec.Auto
	}
	if _, err := codec.ParseSetting(string(o.Codec)); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
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
	b     storage.Backend
	opts  WriterOptions
	bufs  chan *chunkBuf   // the pool; a drain blocks when it is empty
	cpu   chan struct{}    // compression slots
	now   func() time.Time // for tests
	sel   *codec.Selector  // the Auto policy
	meter storageMeter     // feeds sel with how fast the backend takes bytes
	pins  pins             // of incremental saves not yet committed
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
		sel:  codec.NewSelector(codec.SelectorOptions{Workers: opts.Workers}),
	}
	w.meter.sel = w.sel
	for range opts.InFlight {
		w.bufs <- &chunkBuf{}
	}
	return w, nil
}

// alone is planChunks' threshold for a tensor to have chunks of its own:
// a quarter chunk in incremental saves, so that small tensors (adapters,
// norms) that change do not share chunks with the frozen weights beside
// them; none otherwise, which packs chunks fuller.
func (w *Writer) alone() int64 {
	if w.opts.Incremental {
		return w.opts.ChunkSize / 4
	}
	return 0
}

// CheckEnds are the data-space ends of the chunks a save of l is cut into,
// which a client hashes for a CopyCheck.
func (w *Writer) CheckEnds(l *Layout) []int64 { return l.checkEnds(w.opts.ChunkSize, w.alone()) }

// Options returns the effective options.
func (w *Writer) Options() WriterOptions { return w.opts }

// Shard is one rank's staged data.
type Shard struct {
	Target   Target
	Layout   *Layout
	Data     []byte // the staging region; Layout.Region offsets index it
	Metadata []byte
	// Check, when set, is what the client said it copied: chunks are cut
	// at its ends and copied out of Data before they are hashed and
	// compressed, and the shard is not stored unless every hash matches.
	Check *CopyCheck
}

// WriteShard makes a shard durable: its chunks, then its manifest, in the
// folder of its attempt. It does not commit the step (see Store.TryCommit). Data
// is only read. An incremental save's pin stays until Unpin.
func (w *Writer) WriteShard(ctx context.Context, sh *Shard) (_ *Manifest, err error) {
	if err := sh.Target.Validate(); err != nil {
		return nil, err
	}
	if err := sh.Layout.CheckRegion(int64(len(sh.Data))); err != nil {
		return nil, err
	}
	t := sh.Target
	m := &Manifest{
		Format: ManifestFormat, Version: ManifestVersion,
		Job: t.Job, Step: t.Step, Rank: t.Rank, WorldSize: t.WorldSize, Attempt: t.Attempt,
		Created: w.now().UTC(), DataSize: sh.Layout.DataSize,
		Tensors: sh.Layout.Packed, Metadata: sh.Metadata,
	}
	var base *dedupBase
	if w.opts.Incremental {
		m.Version = ManifestVersionKeyed
		defer func() {
			if err != nil {
				w.Unpin(context.WithoutCancel(ctx), t)
			}
		}()
		if base, err = w.dedupBase(ctx, t); err != nil {
			return nil, err
		}
	}
	plan, err := w.plan(sh)
	if err != nil {
		return nil, err
	}
	if len(plan) > 0 {
		obj := t.dataObject()
		if w.opts.SpreadData {
			obj = t.spreadDataObject()
		}
		chunks, macs, nonFinite, err := w.writeData(ctx, t.Job, obj, sh.Data, plan, sh.Layout.Packed, base, sh.Check)
		if err != nil {
			return nil, fmt.Errorf("write %s data: %w", t, err)
		}
		if sh.Check != nil { // before the manifest: without it nothing commits the data
			if err := sh.Check.verify(macs); err != nil {
				_ = w.b.Delete(context.WithoutCancel(ctx), inJob(t.Job, obj)) // best effort: else prune's
				return nil, fmt.Errorf("%s: %w", t, err)
			}
		}
		m.Chunks = chunks
		for _, c := range chunks {
			m.StoredSize += c.Stored
		}
		m.setNonFinite(nonFinite)
	}
	b, err := m.Encode()
	if err != nil {
		return nil, err
	}
	name := t.manifestName()
	if err := w.b.Put(ctx, name, bytes.NewReader(b), int64(len(b))); err != nil {
		return nil, fmt.Errorf("write %s manifest: %w", t, err)
	}
	return m, nil
}

// plan cuts sh into chunks: at its CopyCheck's ends if it has one (the
// chunks its client hashed), else by the writer's options.
func (w *Writer) plan(sh *Shard) ([]chunkPlan, error) {
	if sh.Check == nil {
		return sh.Layout.planChunks(w.opts.ChunkSize, w.alone()), nil
	}
	if err := sh.Check.Validate(sh.Layout, true); err != nil {
		return nil, err
	}
	return sh.Layout.planEnds(sh.Check.Ends), nil
}

// pending is a chunk being compressed; done receives once it is ready.
type pending struct {
	plan      chunkPlan
	buf       *chunkBuf
	chunk     Chunk
	out       []byte        // stored bytes: a slice of data or of buf
	ref       bool          // chunk is an earlier step's: nothing to write
	mac       uint64        // with a check: the raw bytes' MAC
	nonFinite []tensorCount // of the tensors the chunk holds, where not 0
	done      chan struct{}
}

// tensorCount is how many non-finite values a chunk holds of one tensor
// (its index in the packed table).
type tensorCount struct {
	tensor int
	n      int64
}

// writeData compresses chunks in parallel and streams them, in order, into
// one object. Chunks compress out of order but are read in order, so the
// object's layout matches the manifest and the backend sees a plain stream.
// The backend's Put pulls finished chunks itself (chunkReader): no pipe and
// no extra goroutine between compression and the write, which matters when
// every core is busy compressing and each hand-off waits for a free one.
//
// It also counts each tensor's non-finite values (NaN, ±Inf) on the way,
// while the chunk's bytes are in cache for the hash: nonFinite, by
// tensor, is nil when there are none.
//
// With a check it copies each chunk out of data before it is hashed and
// compressed, so that what is hashed is what is stored even if another
// process rewrites data meanwhile (a shared arena), and returns each
// chunk's MAC under the check's key.
func (w *Writer) writeData(ctx context.Context, job, obj string, data []byte, plan []chunkPlan, tensors []Tensor, base *dedupBase, check *CopyCheck) ([]Chunk, []uint64, []int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := &chunkReader{w: w, obj: obj, want: len(plan), queue: make(chan *pending, cap(w.bufs)), tensors: len(tensors)}
	go func() {
		r.err = w.produce(ctx, data, plan, tensors, base, check, r.queue)
		close(r.queue) // publishes r.err to the reader
	}()
	err := w.b.Put(ctx, inJob(job, obj), r, -1)
	r.backendDone() // the time Put spent after the last Read (fsync) was storage's
	cancel()        // stop the producer if Put gave up early
	r.drain()
	if err != nil {
		return nil, nil, nil, err
	}
	return r.chunks, r.macs, r.nonFinite, nil
}

// produce starts one compression per chunk, in order, as buffers and CPU
// slots allow, and queues them for the reader.
func (w *Writer) produce(ctx context.Context, data []byte, plan []chunkPlan, tensors []Tensor, base *dedupBase, check *CopyCheck, queue chan<- *pending) error {
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
			w.encode(data, p, tensors, base, check)
		}()
	}
	return nil
}

// chunkReader is a data object's byte stream as the backend reads it:
// finished chunks in plan order, each buffer back in the pool once read.
// It also times the backend for the Auto policy: between two Reads the
// backend is writing (storage time); inside Read, waiting for a chunk, the
// drain is compression-bound.
type chunkReader struct {
	w       *Writer
	obj     string
	queue   chan *pending
	err     error // the producer's, valid once queue is closed
	want    int
	cur     *pending
	rest    []byte
	chunks  []Chunk
	macs    []uint64 // with a check
	offset  int64
	writing bool // the backend holds data from the last Read
	// nonFinite sums the chunks' counts by tensor (of tensors in all);
	// nil while every count is 0.
	nonFinite []int64
	tensors   int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	r.backendDone()
	n, err := r.read(p)
	if n > 0 {
		r.w.meter.start(int64(n))
		r.writing = true
	}
	return n, err
}

// backendDone ends the backend's current stretch of writing, if any.
func (r *chunkReader) backendDone() {
	if r.writing {
		r.w.meter.stop()
		r.writing = false
	}
}

func (r *chunkReader) read(p []byte) (int, error) {
	for len(r.rest) == 0 {
		r.release()
		next, ok := <-r.queue
		if !ok {
			return 0, r.end()
		}
		<-next.done
		c := next.chunk
		if !next.ref {
			c.Object, c.Offset = r.obj, r.offset
			r.offset += c.Stored
		}
		r.chunks = append(r.chunks, c)
		r.macs = append(r.macs, next.mac)
		for _, tc := range next.nonFinite {
			if r.nonFinite == nil {
				r.nonFinite = make([]int64, r.tensors)
			}
			r.nonFinite[tc.tensor] += tc.n
		}
		r.cur, r.rest = next, next.out
	}
	n := copy(p, r.rest)
	r.rest = r.rest[n:]
	return n, nil
}

// end is the error at the end of the queue: io.EOF only when every chunk
// was produced, so that a cancelled drain can never commit a short object.
func (r *chunkReader) end() error {
	if r.err != nil {
		return r.err
	}
	if len(r.chunks) != r.want {
		return fmt.Errorf("chunk stream ended after %d of %d chunks", len(r.chunks), r.want)
	}
	return io.EOF
}

func (r *chunkReader) release() {
	if r.cur != nil {
		r.w.bufs <- r.cur.buf
		r.cur, r.rest = nil, nil
	}
}

// drain waits for every chunk still compressing and returns all buffers.
func (r *chunkReader) drain() {
	r.release()
	for p := range r.queue {
		<-p.done
		r.w.bufs <- p.buf
	}
}

// encode hashes and compresses one chunk into p.out; a chunk that does not
// shrink is stored raw, and one that base holds is referenced (p.ref). With
// codec.Auto the Selector picks the codec and learns from how long this
// took and how well it shrank.
func (w *Writer) encode(data []byte, p *pending, tensors []Tensor, base *dedupBase, check *CopyCheck) {
	start := time.Now()
	raw := p.plan.gather(data, &p.buf.gather, check != nil)
	if check != nil {
		mac := check.mac()
		mac.Write(raw)
		p.mac = mac.Sum64()
	}
	c := Chunk{RawOffset: p.plan.rawOffset, Raw: p.plan.raw, Hash: codec.HashString(raw)}
	p.nonFinite = countChunk(p.plan, raw, tensors)
	if w.opts.Incremental {
		c.Key = codec.Key(raw)
		if found, ok := base.lookup(c); ok {
			p.chunk, p.ref = found, true
			return
		}
	}
	hashed := time.Now()
	p.out, c.Codec = raw, codec.None
	use := w.opts.Codec
	if use == codec.Auto {
		use = w.sel.Choose(p.plan.dtype)
	}
	if use != codec.None {
		enc, err := codec.Encode(use, p.buf.enc, raw)
		if err == nil && len(enc) < len(raw) {
			p.buf.enc, p.out, c.Codec = enc, enc, use
		}
	}
	c.Stored = int64(len(p.out))
	p.chunk = c
	if w.opts.Codec == codec.Auto {
		w.sel.ObserveChunk(p.plan.dtype, use, len(raw), len(p.out), hashed.Sub(start), time.Since(hashed))
	}
}

// storageMeter measures how fast the backend takes bytes: bytes handed to
// it over the time during which at least one drain's backend was busy
// writing them (between Reads, and from the last Read until Put returns,
// which covers a final fsync). Concurrent drains are measured together, as
// the union of their busy time, because they share the storage.
type storageMeter struct {
	sel   *codec.Selector
	mu    sync.Mutex
	busy  int       // backends writing now
	since time.Time // when busy last went from 0 to 1
	bytes int64     // handed over since the last report
}

// start records that a backend was handed n bytes and is writing.
func (m *storageMeter) start(n int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.busy == 0 {
		m.since = time.Now()
	}
	m.busy++
	m.bytes += n
}

// stop records that a backend is back for more (or done).
func (m *storageMeter) stop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.busy--
	if m.busy == 0 {
		m.sel.ObserveStorage(m.bytes, time.Since(m.since))
		m.bytes = 0
	}
}
