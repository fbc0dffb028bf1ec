package main

import (
	"context"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/storage/posix"
)

// benchIncremental measures serve --incremental: what a save writes when
// 99% of the weights are frozen (loraSaves), and what the content keys
// cost a save where every chunk changed (drain time, alternating with a
// daemon without --incremental on the same disk).
func benchIncremental(cfg config, data []byte, work string) ([]row, error) {
	data = append([]byte(nil), data...) // changed in place below
	plain, err := incrementalDaemon(cfg, work, "plain", false)
	if err != nil {
		return nil, err
	}
	defer plain.close()
	incr, err := incrementalDaemon(cfg, work, "incremental", true)
	if err != nil {
		return nil, err
	}
	defer incr.close()
	var drains [2][]float64
	step := int64(0)
	for range cfg.runs {
		step++
		touch(data, cfg.chunkSize, int64(len(data)), step) // every chunk changes
		// Each goes first in half the runs: a drain right after another is
		// slower (the disk is still busy with the first one's writes).
		for _, i := range [][]int{{0, 1}, {1, 0}}[step%2] {
			s, err := timedSave([]*daemon{plain, incr}[i], step, data)
			if err != nil {
				return nil, err
			}
			drains[i] = append(drains[i], s)
		}
	}
	lora, err := loraSaves(incr, data, cfg.chunkSize, filepath.Join(work, "store-incremental"))
	if err != nil {
		return nil, err
	}
	return []row{
		lora,
		{name: "drain, nothing repeats (vs without --incremental)", unit: "s", ckptd: median(drains[1]), baseline: median(drains[0]), target: "<= 1.05x"},
	}, nil
}

// loraSaves saves data 11 times as a fine-tune's shard laid out as LoRA
// lays it out (64 frozen matrices, each followed by its two small
// adapters, 1% of the bytes, which change at every step) and returns
// the bytes a save writes after the first against the first's.
func loraSaves(d *daemon, data []byte, chunk int64, store string) (row, error) {
	const layers, job = 64, "bench-lora"
	adapter := (int64(len(data)) / 100 / (2 * layers)) &^ 7
	big := (int64(len(data))/layers - 2*adapter) &^ 7
	var later []float64
	var full int64
	for step := int64(1); step <= 11; step++ {
		req := &ckptd.SaveRequest{Job: job, Step: step, WorldSize: 1}
		off := int64(0)
		add := func(name string, n int64) {
			req.Tensors = append(req.Tensors, ckptd.Tensor{Name: name, DType: "BF16", Shape: []int64{n / 2}, Data: data[off : off+n]})
			off += n
		}
		for i := range layers {
			add(fmt.Sprintf("layers.%d.weight", i), big)
			for _, ab := range []string{"a", "b"} {
				data[off] ^= byte(step) | 1 // the adapters train
				add(fmt.Sprintf("layers.%d.lora_%s", i, ab), adapter)
			}
		}
		h, err := d.client.Save(context.Background(), req)
		if err != nil {
			return row{}, err
		}
		if err := h.Wait(context.Background()); err != nil {
			return row{}, err
		}
		n, err := stepBytes(filepath.Join(store, job), step)
		if err != nil {
			return row{}, err
		}
		if step == 1 {
			full = n
		} else {
			later = append(later, float64(n))
		}
	}
	fmt.Printf("incremental: a LoRA-like shard (%d layers, adapters of %s) stores %s in full, %s a save after\n",
		layers, human(adapter), human(full), human(int64(median(later))))
	return row{name: "incremental save, LoRA-like, 1% trains (bytes vs full save)", unit: "MiB", ckptd: median(later) / (1 << 20),
		baseline: float64(full) / (1 << 20), target: "<= 0.02x"}, nil
}

func incrementalDaemon(cfg config, work, name string, incremental bool) (*daemon, error) {
	b, err := posix.New(filepath.Join(work, "store-"+name))
	if err != nil {
		return nil, err
	}
	cfg.incremental = incremental
	return startDaemonOn(cfg, b, work, name, 0, nil)
}

// touch changes one byte in every chunk of data's first n bytes.
func touch(data []byte, chunk, n, step int64) {
	for off := int64(0); off < n; off += chunk {
		data[off] ^= byte(step) | 1
	}
}

// timedSave saves data as step and returns accepted → committed, seconds.
func timedSave(d *daemon, step int64, data []byte) (float64, error) {
	ctx := context.Background()
	h, err := d.client.Save(ctx, request(step, data))
	if err != nil {
		return 0, err
	}
	accepted := time.Now()
	if err := h.Wait(ctx); err != nil {
		return 0, err
	}
	return time.Since(accepted).Seconds(), nil
}

// stepBytes is what the data objects in step's folder of the bench job
// hold.
func stepBytes(jobDir string, step int64) (int64, error) {
	var n int64
	dir := filepath.Join(jobDir, "steps", fmt.Sprintf("%012d", step))
	err := filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		if err != nil || !strings.HasSuffix(path, ".data") {
			return err
		}
		info, err := e.Info()
		if err == nil {
			n += info.Size()
		}
		return err
	})
	return n, err
}
