package main

import (
	"context"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"time"

	"github.com/ckptd/ckptd/storage/posix"
)

// benchIncremental measures serve --incremental: what a save writes when
// 99% of the weights are frozen (10 saves, each changing 1% of the bytes,
// against the first save's bytes), and what the content keys cost a save
// where every chunk changed (drain time, alternating with a daemon without
// --incremental on the same disk).
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
	first := int64(0)
	var later []float64
	for i := range 10 {
		step++
		touch(data, cfg.chunkSize, int64(len(data))/100, step) // the trainable 1%
		if _, err := timedSave(incr, step, data); err != nil {
			return nil, err
		}
		n, err := stepBytes(filepath.Join(work, "store-incremental"), step)
		if err != nil {
			return nil, err
		}
		if i == 0 {
			first = n
			continue
		}
		later = append(later, float64(n))
	}
	// The first of the 10 saves already had a base (the drain runs): the
	// full save's size is that of one where every chunk changed.
	full, err := stepBytes(filepath.Join(work, "store-incremental"), 1)
	if err != nil {
		return nil, err
	}
	fmt.Printf("incremental: a full save stores %s, the first save with 1%% changed %s\n", human(full), human(first))
	return []row{
		{name: "incremental save, 99% frozen (bytes vs full save)", unit: "MiB", ckptd: median(later) / (1 << 20), baseline: float64(full) / (1 << 20), target: "<= 0.02x"},
		{name: "drain, nothing repeats (vs without --incremental)", unit: "s", ckptd: median(drains[1]), baseline: median(drains[0]), target: "<= 1.05x"},
	}, nil
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
func stepBytes(root string, step int64) (int64, error) {
	var n int64
	dir := filepath.Join(root, "bench", "steps", fmt.Sprintf("%012d", step))
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
