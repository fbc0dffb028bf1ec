package main

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/internal/arena"
)

// benchStart times what dominates a daemon's start: opening a fresh
// arena of cfg.size (fallocate, a populated shared mapping, mlock) against
// the same bytes' prefault at the machine's memory bandwidth: a new
// shared-memory file of that size mapped and written once, page by page.
// Seconds per GiB, so that a bigger arena's start can be foreseen.
func benchStart(cfg config) ([]row, error) {
	dir := fmt.Sprintf("/dev/shm/ckptd-bench-start-%d", os.Getpid())
	defer os.RemoveAll(dir)
	var opens, faults []float64
	for range cfg.runs {
		os.RemoveAll(dir)
		start := time.Now()
		a, err := arena.Open(arena.Options{Dir: dir, Size: cfg.size, Lock: true})
		if err != nil {
			return nil, err
		}
		opens = append(opens, time.Since(start).Seconds())
		if err := a.Remove(); err != nil {
			return nil, err
		}
		t, err := prefault(filepath.Join(dir+"-raw"), cfg.size)
		if err != nil {
			return nil, err
		}
		faults = append(faults, t)
	}
	gib := float64(cfg.size) / (1 << 30)
	fmt.Printf("start: arena of %s opened in %.2fs (%.2f s/GiB); a write of every page of a new shm file %.2f s/GiB\n",
		human(cfg.size), median(opens), median(opens)/gib, median(faults)/gib)
	return []row{{name: "daemon start, arena open (vs prefault of its pages)", unit: "s/GiB",
		ckptd: median(opens) / gib, baseline: median(faults) / gib, target: "<= 1.0x"}}, nil
}

// prefault creates a shared-memory file of size bytes, maps it and writes
// one byte per page: the least a start that hands out ready memory does.
func prefault(path string, size int64) (float64, error) {
	defer os.Remove(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	start := time.Now()
	if err := f.Truncate(size); err != nil {
		return 0, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return 0, err
	}
	for i := 0; i < len(mem); i += 4096 {
		mem[i] = 1
	}
	took := time.Since(start).Seconds()
	return took, unix.Munmap(mem)
}
