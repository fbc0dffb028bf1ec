package main

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage/posix"
)

// benchHotRestore times BeginRestore of a step the hot tier holds (the
// bytes verified against their chunk hashes and copied into the arena, no
// storage read) against a plain memcpy of as many bytes into warm shared
// memory, and against the same restore from the local disk.
func benchHotRestore(cfg config, data []byte, work string) ([]row, error) {
	ctx := context.Background()
	b, err := posix.New(filepath.Join(work, "hotstore"))
	if err != nil {
		return nil, err
	}
	d, err := startDaemonOn(cfg, b, work, "hot", cfg.size+(64<<20), nil)
	if err != nil {
		return nil, err
	}
	defer d.close()
	h, err := d.client.Save(ctx, request(1, data))
	if err != nil {
		return nil, err
	}
	if err := h.Wait(ctx); err != nil {
		return nil, err
	}
	var ts []float64
	for range cfg.runs {
		start := time.Now()
		resp, err := d.client.API().BeginRestore(ctx, &pb.BeginRestoreRequest{Step: 1})
		if err != nil {
			return nil, err
		}
		ts = append(ts, time.Since(start).Seconds())
		if _, err := d.client.API().ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: resp.GetLease().GetId()}); err != nil {
			return nil, err
		}
	}
	memcpy, err := memcpyBaseline(cfg, data)
	if err != nil {
		return nil, err
	}
	size := float64(len(data))
	fmt.Printf("hot tier: restore of a held step %.2f GB/s; memcpy into warm shm %.2f GB/s\n", size/median(ts)/1e9, size/memcpy/1e9)
	return []row{{name: "hot-tier restore (vs memcpy to warm shm)", unit: "GB/s", ckptd: size / median(ts) / 1e9, baseline: size / memcpy / 1e9, target: ">= 0.8x"}}, nil
}
