package prefetch

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/ckptd/ckptd/budget"
)

// diskCache is the disk tier (serve's --disk-cache-dir, --disk-cache-bytes):
// the shards read from remote sources (S3), kept as files on a local disk
// within a byte budget, so that a dataset larger than memory is read from
// the store once per node rather than once per epoch. A shard read whole
// is written once its readers have it, and mapped when found there, as a
// local source's shards are; one streamed is written as it passes
// (Cache.stream) and streamed from the file, checked first.
//
// A file is written under a temporary name, synced and renamed into
// place, so no file of the tier's names is ever incomplete: a crash
// leaves at most a temporary, removed at the next start. Its name is a
// hash of the shard's cache key, which holds the store, the object's
// name, size and modification time (what the listing says): a shard
// rewritten in the store is another file, never the old bytes. The file
// ends with a trailer (the shard's size and xxh3) that is checked each
// time it is mapped, so a file damaged or cut on the disk is dropped and
// read from the store again, never served.
//
// Eviction follows the memory cache's rule over the open sessions' known
// orders: when the tier is full, the shard read farthest in the future
// goes (one no session plans to read first, then the least recently
// used), and a shard whose next read comes later than every kept one's is
// not written.
type diskCache struct {
	dir    string
	budget int64
	log    *slog.Logger

	mu    sync.Mutex
	used  int64
	files map[string]*diskFile // by file name
	// hit and usage report the tier's hits and bytes (metrics; may be nil).
	hit   func()
	usage func(int64)
}

type diskFile struct {
	key     string // the shard's cache key ("" for a file of an earlier run)
	size    int64  // bytes on disk, trailer included
	used    time.Time
	writing bool // not in place yet
}

const (
	diskSuffix  = ".shard"
	diskTemp    = ".tmp"
	diskTrailer = 16 // uint64 size, uint64 xxh3 of the shard
)

// newDiskCache opens the tier in dir (made if missing), removing what a
// crash left half written and counting the files of earlier runs, which
// are served again, and evicted first when room is needed.
func newDiskCache(dir string, limit int64, log *slog.Logger) (*diskCache, error) {
	if limit <= 0 {
		return nil, budget.Wrap(fmt.Errorf("%w: the disk tier's budget is %d bytes: give it a positive one", ErrInvalid, limit), budget.DiskCache)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, budget.Wrap(fmt.Errorf("%w: the disk tier's folder %s: %w", ErrInvalid, dir, err), budget.DiskCache)
	}
	d := &diskCache{dir: dir, budget: limit, log: log, files: map[string]*diskFile{}}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, budget.Wrap(fmt.Errorf("%w: the disk tier's folder %s: %w", ErrInvalid, dir, err), budget.DiskCache)
	}
	for _, e := range entries {
		name := e.Name()
		switch {
		case strings.HasSuffix(name, diskTemp):
			_ = os.Remove(filepath.Join(dir, name)) // a write a crash cut short
		case strings.HasSuffix(name, diskSuffix) && e.Type().IsRegular():
			fi, err := e.Info()
			if err != nil {
				continue
			}
			d.files[name] = &diskFile{size: fi.Size(), used: fi.ModTime()}
			d.used += fi.Size()
		}
	}
	var victims []string
	over := d.used - d.budget // the budget shrank since
	for _, v := range d.ranked(nil) {
		if over <= 0 {
			break
		}
		victims = append(victims, v)
		over -= d.files[v].size
	}
	d.unlink(d.evict(victims))
	return d, nil
}

// fileName is a shard's file in the tier.
func diskName(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:]) + diskSuffix
}

// lookup finds the file of key in the books, marking it used, unless it
// is not there or still being written.
func (d *diskCache) lookup(key string) (string, *diskFile, bool) {
	name := diskName(key)
	d.mu.Lock()
	defer d.mu.Unlock()
	f := d.files[name]
	if f == nil || f.writing {
		return "", nil, false
	}
	f.used, f.key = time.Now(), key
	return name, f, true
}

// load maps the shard of key, size bytes, when the tier holds it whole.
func (d *diskCache) load(key string, size int64) (shardBytes, bool) {
	name, f, ok := d.lookup(key)
	if !ok {
		return shardBytes{}, false
	}
	m, err := d.mapFile(name, size)
	if err != nil {
		if !errors.Is(err, errNoMapping) {
			d.log.Warn("dropped a shard of the disk cache", "file", name, "err", err)
			d.discard(name, f)
		}
		return shardBytes{}, false
	}
	return shardBytes{b: m.data[:size:size], m: m}, true
}

// mapFile maps a tier file and checks its trailer against the shard.
func (d *diskCache) mapFile(name string, size int64) (*mapping, error) {
	fh, err := os.Open(filepath.Join(d.dir, name))
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	fi, err := fh.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() != size+diskTrailer {
		return nil, fmt.Errorf("%d bytes on disk for a shard of %d", fi.Size(), size)
	}
	m, err := mapFile(fh, fi.Size())
	if err != nil {
		return nil, err
	}
	err = readMapped(func() error {
		t := m.data[size:]
		if n := int64(binary.LittleEndian.Uint64(t)); n != size {
			return fmt.Errorf("its trailer says %d bytes, the shard has %d", n, size)
		}
		if sum := binary.LittleEndian.Uint64(t[8:]); sum != xxh3.Hash(m.data[:size]) {
			return errors.New("its bytes differ from their checksum")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

// store returns the write of a shard read from the store into the tier,
// or nil when the eviction rule does not admit it (next: how far each kept
// shard's next read is, nil when no session plans any; mine: this one's)
// or the tier has it. The caller runs the write once the shard's readers
// have it (a fill, after it is done); data must not change until then.
func (d *diskCache) store(key string, data []byte, next func(string) int, mine int) func() {
	name, f := d.reserve(key, int64(len(data)), next, mine)
	if f == nil {
		return nil
	}
	return func() {
		w, err := d.create(name, f)
		if err == nil {
			if _, err = w.Write(data); err == nil {
				err = w.commit()
			}
		}
		if err != nil {
			w.abort(err)
		}
	}
}

// reserve makes room for a shard of size bytes (and its trailer) in the
// books, if the eviction rule admits it, and returns its file's name and
// entry (nil: not kept).
func (d *diskCache) reserve(key string, shard int64, next func(string) int, mine int) (string, *diskFile) {
	name := diskName(key)
	size := shard + diskTrailer
	if size > d.budget {
		return "", nil
	}
	d.mu.Lock()
	if d.files[name] != nil {
		d.mu.Unlock()
		return "", nil
	}
	var victims []string
	free := d.budget - d.used
	for _, v := range d.ranked(next) {
		if free >= size {
			break
		}
		if f := d.files[v]; next != nil && f.key != "" && next(f.key) <= mine {
			break // every shard left is read again before this one: it is not kept
		}
		victims = append(victims, v)
		free += d.files[v].size
	}
	if free < size {
		d.mu.Unlock()
		return "", nil
	}
	doomed := d.evict(victims)
	f := &diskFile{key: key, size: size, used: time.Now(), writing: true}
	d.files[name] = f
	d.used += size
	d.report()
	d.mu.Unlock()
	d.unlink(doomed)
	return name, f
}

// diskWriter writes one shard into the tier: a temporary file, its bytes
// hashed as they come, renamed into place by commit once they are all
// there.
type diskWriter struct {
	d    *diskCache
	name string
	f    *diskFile
	tmp  *os.File
	h    *xxh3.Hasher
	n    int64
	err  error // the first write error: later writes are dropped
}

// create starts the write of a reserved file.
func (d *diskCache) create(name string, f *diskFile) (*diskWriter, error) {
	w := &diskWriter{d: d, name: name, f: f, h: xxh3.New()}
	tmp, err := os.CreateTemp(d.dir, "*"+diskTemp)
	w.tmp = tmp
	return w, err
}

// Write copies p into the file. It never fails: a shard streamed from
// storage is teed into it, and a full or broken disk must not pass for
// a broken shard. The first error is kept for commit, which gives up.
func (w *diskWriter) Write(p []byte) (int, error) {
	if w.err != nil {
		return len(p), nil
	}
	n, err := w.tmp.Write(p)
	w.h.Write(p[:n])
	w.n += int64(n)
	w.err = err
	return len(p), nil
}

// commit ends the write: the trailer, a sync, the rename into place.
func (w *diskWriter) commit() error {
	if w.err != nil {
		return w.err
	}
	if w.n+diskTrailer != w.f.size {
		return fmt.Errorf("%d bytes written of a shard of %d", w.n, w.f.size-diskTrailer)
	}
	var trailer [diskTrailer]byte
	binary.LittleEndian.PutUint64(trailer[:], uint64(w.n))
	binary.LittleEndian.PutUint64(trailer[8:], w.h.Sum64())
	_, err := w.tmp.Write(trailer[:])
	if err == nil {
		err = w.tmp.Sync()
	}
	if cerr := w.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(w.tmp.Name(), filepath.Join(w.d.dir, w.name))
	}
	if err != nil {
		return err
	}
	if dir, err := os.Open(w.d.dir); err == nil {
		_ = dir.Sync()
		dir.Close()
	}
	w.d.mu.Lock()
	w.f.writing = false
	w.d.mu.Unlock()
	return nil
}

// abort gives up the write (err: why, nil when the shard was not read
// whole) and its room.
func (w *diskWriter) abort(err error) {
	if w.tmp != nil {
		w.tmp.Close()
		_ = os.Remove(w.tmp.Name())
	}
	if err != nil {
		w.d.log.Warn("could not write a shard to the disk cache", "dir", w.d.dir, "err", err)
	}
	// Nothing is under the reserved name yet (commit renames last): only
	// the reservation goes, and only this one.
	w.d.mu.Lock()
	if w.d.files[w.name] == w.f {
		w.d.drop(w.name)
	}
	w.d.mu.Unlock()
}

// open opens a shard of size bytes the tier holds, to stream: its whole
// file is read once first to check its trailer, so that what is streamed
// is what was written (a file cut or damaged is dropped).
func (d *diskCache) open(key string, size int64) (io.ReadCloser, bool) {
	name, f, ok := d.lookup(key)
	if !ok {
		return nil, false
	}
	fh, err := os.Open(filepath.Join(d.dir, name))
	if err == nil {
		err = checkTrailer(fh, size)
	}
	if err != nil {
		if fh != nil {
			fh.Close()
		}
		d.log.Warn("dropped a shard of the disk cache", "file", name, "err", err)
		d.discard(name, f)
		return nil, false
	}
	return &sectionFile{io.NewSectionReader(fh, 0, size), fh}, true
}

// checkTrailer reads a tier file through and checks it against its trailer.
func checkTrailer(fh *os.File, size int64) error {
	fi, err := fh.Stat()
	if err != nil {
		return err
	}
	if fi.Size() != size+diskTrailer {
		return fmt.Errorf("%d bytes on disk for a shard of %d", fi.Size(), size)
	}
	h := xxh3.New()
	if _, err := io.Copy(h, io.NewSectionReader(fh, 0, size)); err != nil {
		return err
	}
	var t [diskTrailer]byte
	if _, err := fh.ReadAt(t[:], size); err != nil {
		return err
	}
	if int64(binary.LittleEndian.Uint64(t[:])) != size || binary.LittleEndian.Uint64(t[8:]) != h.Sum64() {
		return errors.New("its bytes differ from its trailer")
	}
	return nil
}

// ranked is the files in the order they go when room is needed: those
// read farthest ahead first (never read: first of all), the least recently
// used among equals; files being written are not among them. Call with mu.
func (d *diskCache) ranked(next func(string) int) []string {
	type cand struct {
		name string
		next int
		used time.Time
	}
	var cs []cand
	for name, f := range d.files {
		if f.writing {
			continue
		}
		n := math.MaxInt
		if next != nil && f.key != "" {
			n = next(f.key)
		}
		cs = append(cs, cand{name, n, f.used})
	}
	slices.SortFunc(cs, func(a, b cand) int {
		if a.next != b.next {
			return cmp.Compare(b.next, a.next)
		}
		return a.used.Compare(b.used)
	})
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.name
	}
	return out
}

func (d *diskCache) drop(name string) {
	if f := d.files[name]; f != nil {
		d.used -= f.size
		delete(d.files, name)
		d.report()
	}
}

// report tells the metrics what the tier holds. Call with mu.
func (d *diskCache) report() {
	if d.usage != nil {
		d.usage(d.used)
	}
}

// discard evicts the file found as f under name, if the books still hold
// that one: a shard dropped and reserved again since is another's.
func (d *diskCache) discard(name string, f *diskFile) {
	d.mu.Lock()
	var doomed []string
	if d.files[name] == f {
		doomed = d.evict([]string{name})
	}
	d.mu.Unlock()
	d.unlink(doomed)
}

// evict takes files out of the books and moves each out of its name, to
// a temporary one it returns for unlink. Call with mu: a name is free for
// a new reservation only once its old file has left it, else that write's
// rename could land first and be the file removed. Unlinking, which frees
// a large file's blocks, waits until mu is released.
func (d *diskCache) evict(names []string) []string {
	var doomed []string
	for _, n := range names {
		d.drop(n)
		from := filepath.Join(d.dir, n)
		to := from + ".evicted" + diskTemp // a crash leaves it to the next start
		if err := os.Rename(from, to); err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				d.log.Warn("could not remove a shard of the disk cache", "file", n, "err", err)
			}
			continue
		}
		doomed = append(doomed, to)
	}
	return doomed
}

// unlink deletes what evict moved aside (a mapping of one stays valid
// until it is unmapped).
func (d *diskCache) unlink(paths []string) {
	for _, p := range paths {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			d.log.Warn("could not remove a shard of the disk cache", "file", filepath.Base(p), "err", err)
		}
	}
}
