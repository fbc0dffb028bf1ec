package checkpoint

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage"
)

// autoWriter is a Writer with codec auto whose policy assumes the given
// storage rate instead of measuring it, so that its choices are fixed.
func autoWriter(t *testing.T, b storage.Backend, storageRate float64) *Writer {
	t.Helper()
	w, err := NewWriter(b, WriterOptions{ChunkSize: 64 << 10, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if w.Options().Codec != codec.Auto {
		t.Fatalf("default codec %q, want auto", w.Options().Codec)
	}
	w.sel = codec.NewSelector(codec.SelectorOptions{Workers: 2, StorageRate: storageRate})
	w.meter.sel = w.sel
	return w
}

// chunkDTypes maps each chunk of m to the dtype of the tensor it starts in.
func chunkDTypes(m *Manifest) []dtype.DType {
	out := make([]dtype.DType, len(m.Chunks))
	for i, c := range m.Chunks {
		for _, t := range m.Tensors {
			if t.Length > 0 && t.Offset <= c.RawOffset && c.RawOffset < t.Offset+t.Length {
				out[i] = t.DType
			}
		}
	}
	return out
}

// restoreEqual reads the shard back and compares it with what was saved.
func restoreEqual(t *testing.T, b storage.Backend, sh *Shard) *Manifest {
	t.Helper()
	store, _ := NewStore(b, "job")
	rec, err := store.Resolve(context.Background(), sh.Target.Step, false)
	if err != nil {
		t.Fatal(err)
	}
	m, err := store.Manifest(context.Background(), rec, sh.Target.Rank)
	if err != nil {
		t.Fatal(err)
	}
	got := make(BufferSink, m.DataSize)
	if err := store.ReadShard(context.Background(), m, got, ReadOptions{}); err != nil {
		t.Fatal(err)
	}
	if string(got) != string(sh.Data) {
		t.Fatal("restored bytes differ")
	}
	return m
}

// TestAutoCodecByDType: with slow storage, auto stores float chunks with
// the float codec of their width and integer chunks with zstd, records
// that per chunk, and the shard restores.
func TestAutoCodecByDType(t *testing.T) {
	b, _ := newBackend(t)
	w := autoWriter(t, b, 1e6) // slower than compressing, even under -race
	sh := writeStep(t, b, w, 4, 1)[0]
	m := restoreEqual(t, b, sh)
	seen := map[codec.Codec]bool{}
	for i, dt := range chunkDTypes(m) {
		c := m.Chunks[i]
		seen[c.Codec] = true
		switch {
		case c.Codec == codec.None:
			// Stored raw: only chunks too small to shrink.
			if c.Raw > 4096 {
				t.Errorf("chunk %d (%s, %d bytes) stored raw", i, dt, c.Raw)
			}
		case c.Codec != codec.ForDType(dt):
			t.Errorf("chunk %d (%s) written with %s, want %s", i, dt, c.Codec, codec.ForDType(dt))
		}
	}
	if !seen[codec.FloatF32] || !seen[codec.Zstd] {
		t.Errorf("codecs used: %v; want float-f32 and zstd among them", seen)
	}
}

// TestAutoFastStorage: when storage takes bytes faster than two workers can
// compress them, auto stores float chunks raw, but keeps trying the float
// codec now and then; every chunk restores whatever it was written with.
func TestAutoFastStorage(t *testing.T) {
	b, _ := newBackend(t)
	w := autoWriter(t, b, 1e12)
	sh := writeStep(t, b, w, 5, 1)[0]
	m := restoreEqual(t, b, sh)
	count := map[codec.Codec]int{}
	for i, dt := range chunkDTypes(m) {
		if dt == dtype.F32 {
			count[m.Chunks[i].Codec]++
		}
	}
	if count[codec.None] < count[codec.FloatF32] || count[codec.FloatF32] == 0 {
		t.Errorf("fp32 chunks by codec: %v; want mostly none, float-f32 at first and when exploring", count)
	}
}

// slowBackend takes Put streams at about a fixed rate, like a disk would,
// and keeps the rate it really had (sleeps overshoot on a busy machine).
type slowBackend struct {
	storage.Backend
	rate  float64 // bytes/s
	bytes *int64
	slept *time.Duration
}

func (s slowBackend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	return s.Backend.Put(ctx, name, &slowReader{r: r, b: s}, size)
}

type slowReader struct {
	r io.Reader
	b slowBackend
}

func (s *slowReader) Read(p []byte) (int, error) {
	n, err := s.r.Read(p[:min(len(p), 256<<10)])
	// The time is spent after the read returns, as a backend's write is.
	start := time.Now()
	time.Sleep(time.Duration(float64(n) / s.b.rate * float64(time.Second)))
	*s.b.slept += time.Since(start)
	*s.b.bytes += int64(n)
	return n, err
}

// TestAutoMeasuresStorage: the writer measures how fast the backend takes
// the stream (time between Reads), not how fast chunks are produced.
func TestAutoMeasuresStorage(t *testing.T) {
	pb, _ := newBackend(t)
	b := slowBackend{Backend: pb, rate: 100e6, bytes: new(int64), slept: new(time.Duration)}
	w, err := NewWriter(b, WriterOptions{ChunkSize: 1 << 20, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	sh := bigShard(12 << 20)
	if _, err := w.WriteShard(context.Background(), sh); err != nil {
		t.Fatal(err)
	}
	// The backend's busy time is its sleeps plus the real writes, so the
	// whole stream's rate is under the sleeps' rate; how far under depends
	// on the machine's load, hence the loose lower bound. The measurement
	// is an average of samples' rates, the later weighing more, so on a
	// busy machine (sleeps overslept unevenly) it can pass the whole
	// stream's rate; what it must never be is the compression's rate,
	// several times faster than this backend.
	got, want := w.sel.StorageRate(), float64(*b.bytes)/b.slept.Seconds()
	if got < want/4 || got > want*2 {
		t.Errorf("measured storage at %.3g B/s, want about %.3g", got, want)
	}
}

func bigShard(n int) *Shard {
	data := floats(n/4, 3)
	l, err := NewLayout([]Tensor{{Name: "w", DType: dtype.F32, Shape: []int64{int64(n / 4)}, Offset: 0, Length: int64(len(data))}})
	if err != nil {
		panic(err)
	}
	return &Shard{Target: Target{Job: "job", Step: 1, Rank: 0, WorldSize: 1, Attempt: testAttempt}, Layout: l, Data: data}
}
