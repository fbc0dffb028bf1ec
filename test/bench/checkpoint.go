package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/arena"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage/posix"
)

// request splits data into 8 bf16 tensors, as a shard of a model would be.
func request(step int64, data []byte) *ckptd.SaveRequest {
	const parts = 8
	req := &ckptd.SaveRequest{Step: step, WorldSize: 1}
	per := (int64(len(data)) / parts) &^ 1
	for i := range int64(parts) {
		end := (i + 1) * per
		if i == parts-1 {
			end = int64(len(data))
		}
		chunk := data[i*per : end]
		req.Tensors = append(req.Tensors, ckptd.Tensor{
			Name: fmt.Sprintf("layers.%d.weight", i), DType: "BF16", Shape: []int64{int64(len(chunk) / 2)}, Data: chunk,
		})
	}
	return req
}

// benchSaveAndDrain times save stalls and drains over cfg.runs steps.
func benchSaveAndDrain(cfg config, d *daemon, data []byte, work string) ([]row, error) {
	ctx := context.Background()
	memcpy, err := memcpyBaseline(cfg, data)
	if err != nil {
		return nil, err
	}
	var stalls, drains []float64
	for i := range cfg.runs {
		req := request(int64(i+1), data)
		start := time.Now()
		h, err := d.client.Save(ctx, req)
		if err != nil {
			return nil, err
		}
		accepted := time.Now()
		if err := h.Wait(ctx); err != nil {
			return nil, err
		}
		stalls = append(stalls, accepted.Sub(start).Seconds())
		drains = append(drains, float64(len(data))/time.Since(accepted).Seconds())
	}
	raw, err := rawWriteBaseline(cfg, data, work)
	if err != nil {
		return nil, err
	}
	enc, err := codecBaseline(cfg, data)
	if err != nil {
		return nil, err
	}
	base, which := raw, "raw O_DIRECT write"
	if enc < raw {
		base, which = enc, "codec alone"
	}
	fmt.Printf("baselines: memcpy into warm shm %.2f GB/s; raw O_DIRECT write %.2f GB/s; %s alone %.2f GB/s\n",
		float64(len(data))/memcpy/1e9, raw/1e9, cfg.codec, enc/1e9)
	return []row{
		{name: "save stall (vs memcpy to warm shm)", unit: "s", ckptd: median(stalls), baseline: memcpy, target: "<= 1.2x"},
		{name: "drain (vs " + which + ")", unit: "GB/s", ckptd: median(drains) / 1e9, baseline: base / 1e9, target: ">= 0.9x"},
	}, nil
}

// memcpyBaseline copies data into a warm shared-memory mapping the size of
// the shard, the floor for any save through shared memory.
func memcpyBaseline(cfg config, data []byte) (float64, error) {
	a, err := arena.Open(arena.Options{Dir: fmt.Sprintf("/dev/shm/ckptd-bench-memcpy-%d", os.Getpid()), Size: int64(len(data)) + 1<<20})
	if err != nil {
		return 0, err
	}
	defer a.Remove()
	m, err := arena.Map(a.Path(), a.Size())
	if err != nil {
		return 0, err
	}
	defer m.Close()
	dst := m.Bytes()
	copy(dst, data) // warm: pages faulted in this mapping too
	var ts []float64
	for range cfg.runs {
		start := time.Now()
		copy(dst, data)
		ts = append(ts, time.Since(start).Seconds())
	}
	return median(ts), nil
}

// rawWriteBaseline writes data with O_DIRECT + fsync to the storage disk.
func rawWriteBaseline(cfg config, data []byte, work string) (float64, error) {
	var ts []float64
	path := filepath.Join(work, "raw.bin")
	for range cfg.runs {
		start := time.Now()
		if err := posix.WriteDirect(path, data); err != nil {
			return 0, err
		}
		ts = append(ts, float64(len(data))/time.Since(start).Seconds())
		os.Remove(path)
	}
	return median(ts), nil
}

// codecBaseline compresses data in chunks on cfg.workers goroutines, with
// no I/O and no hashing: what the drain could do if storage were free.
func codecBaseline(cfg config, data []byte) (float64, error) {
	c := cfg.codec
	if c == codec.Auto {
		c = codec.ForDType("BF16") // what auto starts with on this shard
	}
	var ts []float64
	for range cfg.runs {
		start := time.Now()
		if err := parallelChunks(cfg, data, func(chunk []byte, buf *[]byte) error {
			out, err := codec.Encode(c, *buf, chunk)
			*buf = out
			return err
		}); err != nil {
			return 0, err
		}
		ts = append(ts, float64(len(data))/time.Since(start).Seconds())
	}
	return median(ts), nil
}

// parallelChunks runs fn over cfg.chunkSize pieces of data on cfg.workers
// goroutines, each with its own scratch buffer.
func parallelChunks(cfg config, data []byte, fn func(chunk []byte, buf *[]byte) error) error {
	var g errgroup.Group
	next := make(chan int64)
	go func() {
		for off := int64(0); off < int64(len(data)); off += cfg.chunkSize {
			next <- off
		}
		close(next)
	}()
	var mu sync.Mutex
	var first error
	for range cfg.workers {
		g.Go(func() error {
			var buf []byte
			for off := range next {
				end := min(off+cfg.chunkSize, int64(len(data)))
				if err := fn(data[off:end], &buf); err != nil {
					mu.Lock()
					first = err
					mu.Unlock()
				}
			}
			return nil
		})
	}
	_ = g.Wait()
	return first
}

// benchRestore times BeginRestore of the last saved step against reading
// its data object and decompressing the chunks.
func benchRestore(cfg config, d *daemon, work string) ([]row, error) {
	ctx := context.Background()
	api := d.client.API()
	step := int64(cfg.runs)
	var ts []float64
	var size float64
	for range cfg.runs {
		start := time.Now()
		resp, err := api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: step})
		if err != nil {
			return nil, err
		}
		ts = append(ts, time.Since(start).Seconds())
		size = float64(resp.GetHeader().GetSize())
		if _, err := api.ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: resp.GetLease().GetId()}); err != nil {
			return nil, err
		}
	}
	base, err := readDecodeBaseline(cfg, d, step, work)
	if err != nil {
		return nil, err
	}
	fmt.Printf("baseline: raw read + %s decode %.2f GB/s\n", cfg.codec, base/1e9)
	return []row{{name: "restore (vs raw read + decode)", unit: "GB/s", ckptd: size / median(ts) / 1e9, baseline: base / 1e9, target: ">= 0.9x"}}, nil
}

// readDecodeBaseline reads the step's data object into a warm buffer and
// decodes its chunks in parallel into another, with the same chunk table
// but no hashing, no arena and no RPC.
func readDecodeBaseline(cfg config, d *daemon, step int64, work string) (float64, error) {
	_, m, err := manifestOf(d, step)
	if err != nil {
		return 0, err
	}
	f, err := os.Open(filepath.Join(work, "store", "bench", m.Chunks[0].Object))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	stored := make([]byte, m.StoredSize)
	out := make([]byte, m.DataSize)
	clear(stored) // fault the pages in now, as the arena's are
	clear(out)
	var ts []float64
	for range cfg.runs {
		start := time.Now()
		if _, err := f.ReadAt(stored, 0); err != nil {
			return 0, err
		}
		if err := decodeAll(cfg, m, stored, out); err != nil {
			return 0, err
		}
		ts = append(ts, float64(m.DataSize)/time.Since(start).Seconds())
	}
	return median(ts), nil
}
