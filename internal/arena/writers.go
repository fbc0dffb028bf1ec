package arena

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// writersDir holds one empty file per region a client may be writing
// into (AllocWriter until Seal or Free), named <offset>-<length>. After a
// crash it tells the next daemon which space the dead daemon's clients may
// still be copying into: only that is fenced (Options.Fence), and the rest
// of the arena is usable at once. An arena without it was left by a daemon
// that kept no such record, and is fenced whole.
const writersDir = "writers"

// writers is the record of client-written regions, and the regions a
// dead daemon's clients may still write, held until their fence ends.
type writers struct {
	dir string
	log *slog.Logger

	mu      sync.Mutex
	regions map[int64]int64       // offset → length of the recorded regions
	fenced  map[int64]*time.Timer // a dead daemon's writers' regions, by offset
	closed  bool
}

// openWriters makes the record in dir, reporting whether it was there: a
// daemon that keeps one left it.
func openWriters(dir string, log *slog.Logger) (*writers, bool, error) {
	err := os.Mkdir(dir, dirMode)
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, false, fmt.Errorf("arena: %w", err)
	}
	return &writers{dir: dir, log: log, regions: map[int64]int64{}, fenced: map[int64]*time.Timer{}}, err != nil, nil
}

func markerName(r Region) string { return fmt.Sprintf("%d-%d", r.Offset, r.Length) }

// parseMarker reads a marker's name back into its region.
func parseMarker(name string) (Region, bool) {
	off, n, ok := strings.Cut(name, "-")
	o, err1 := strconv.ParseInt(off, 10, 64)
	l, err2 := strconv.ParseInt(n, 10, 64)
	return Region{Offset: o, Length: l}, ok && err1 == nil && err2 == nil && markerName(Region{o, l}) == name
}

// AllocWriter is Alloc for a region a client writes into (a save's
// region), recorded as such until Seal or Free, so that a daemon taking
// over after a crash knows to keep it from others for a while.
func (a *Arena) AllocWriter(ctx context.Context, n int64) (Region, error) {
	r, err := a.Alloc(ctx, n)
	if err != nil {
		return r, err
	}
	if err := a.writers.record(r); err != nil {
		_ = a.alloc.freeRegion(r)
		return Region{}, err
	}
	return r, nil
}

// Seal says that no client writes into r any more (the save it holds is
// journaled); r stays allocated.
func (a *Arena) Seal(r Region) { a.writers.forget(r) }

func (w *writers) record(r Region) error {
	f, err := os.OpenFile(filepath.Join(w.dir, markerName(r)), os.O_CREATE|os.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, privateMode)
	if err != nil {
		return fmt.Errorf("arena: record a writer's region: %w", err)
	}
	f.Close()
	w.mu.Lock()
	w.regions[r.Offset] = r.Length
	w.mu.Unlock()
	return nil
}

// forget drops r's record, if it has one.
func (w *writers) forget(r Region) {
	w.mu.Lock()
	n, ok := w.regions[r.Offset]
	delete(w.regions, r.Offset)
	w.mu.Unlock()
	if ok && n == r.Length {
		if err := os.Remove(filepath.Join(w.dir, markerName(r))); err != nil && !errors.Is(err, fs.ErrNotExist) {
			w.log.Warn("arena: could not remove a writer's record; a crash now would fence its region needlessly", "region", r, "err", err)
		}
	}
}

// fenceLeft reserves the regions a dead daemon's clients may still be
// writing, as its record names them, and frees each after fence. A record
// that names no region of this arena is dropped.
func (w *writers) fenceLeft(alloc *allocator, fence time.Duration) (int, error) {
	des, err := os.ReadDir(w.dir)
	if err != nil {
		return 0, fmt.Errorf("arena: read the writers' record: %w", err)
	}
	n := 0
	for _, de := range des {
		r, ok := parseMarker(de.Name())
		if ok {
			ok = alloc.reserve(r) == nil
		}
		if !ok {
			w.log.Warn("arena: dropped a writer's record that names no free region", "record", de.Name())
			_ = os.Remove(filepath.Join(w.dir, de.Name()))
			continue
		}
		w.mu.Lock()
		w.regions[r.Offset] = r.Length
		w.fenced[r.Offset] = time.AfterFunc(fence, func() { w.release(alloc, r) })
		w.mu.Unlock()
		n++
	}
	return n, nil
}

// release frees a dead daemon's writer's region once its fence is over.
func (w *writers) release(alloc *allocator, r Region) {
	w.mu.Lock()
	t, ok := w.fenced[r.Offset]
	delete(w.fenced, r.Offset)
	closed := w.closed
	w.mu.Unlock()
	if !ok || t == nil || closed {
		return
	}
	w.forget(r)
	_ = alloc.freeRegion(r)
}

// adopt takes r out of the fence when it is a fenced region exactly: a
// save journaled just before the crash, whose record was not yet dropped,
// is the journal's to hold now. A fenced region that overlaps r without
// being it is given back first: the journal names acknowledged saves, and
// its regions come before any record of a writer.
func (w *writers) adopt(alloc *allocator, r Region) bool {
	w.mu.Lock()
	var exact bool
	var overlap []Region
	for off, t := range w.fenced {
		f := Region{Offset: off, Length: w.regions[off]}
		if off >= r.Offset+r.Length || r.Offset >= off+alignUp(f.Length, pageSize) {
			continue
		}
		t.Stop()
		delete(w.fenced, off)
		if f == r {
			exact = true
		} else {
			overlap = append(overlap, f)
		}
	}
	w.mu.Unlock()
	for _, f := range overlap {
		w.log.Warn("arena: a writer's record overlaps a journaled save; the save wins", "record", f, "save", r)
		w.forget(f)
		_ = alloc.freeRegion(f)
	}
	if exact {
		w.forget(r)
	}
	return exact
}

// clear removes every record: they name regions of an arena file that is
// gone.
func (w *writers) clear() {
	des, err := os.ReadDir(w.dir)
	if err != nil {
		return
	}
	for _, de := range des {
		_ = os.Remove(filepath.Join(w.dir, de.Name()))
	}
}

// close stops the fences' timers; what they hold goes with the arena.
func (w *writers) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	for _, t := range w.fenced {
		t.Stop()
	}
}
