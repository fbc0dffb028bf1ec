// Package memstore is a storage.Backend that keeps its objects in memory,
// for tests that need a store without a disk or a server (wrap it in
// storage/faulty to simulate an outage). It keeps S3's semantics rather
// than a file system's: a name may be an object and the prefix of others
// at once ("a" and "a/b"). It passes the storagetest suite.
//
// Nothing bounds its memory: it holds every object whole, and Put holds the
// new object whole before it replaces the old one. It is not for
// production use.
package memstore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// ErrClosed: the backend was used after Close.
var ErrClosed = errors.New("memstore: backend closed")

// readBlock is how much Put reads between checks of its context.
const readBlock = 1 << 20

// Backend is an in-memory object store, safe for concurrent use.
type Backend struct {
	location string

	mu      sync.RWMutex
	objects map[string]object
	closed  bool
}

// object is immutable once stored: Put replaces it, so a reader from Get
// keeps the version it opened.
type object struct {
	data    []byte
	modTime time.Time
}

var _ storage.Backend = (*Backend)(nil)

var instances atomic.Int64

// New returns an empty store. Its Location is "mem://N", N telling stores
// of one process apart.
func New() *Backend {
	return &Backend{
		location: fmt.Sprintf("mem://%d", instances.Add(1)),
		objects:  map[string]object{},
	}
}

// Location implements storage.Backend.
func (b *Backend) Location() string { return b.location }

// Close implements storage.Backend: it drops the objects, and later calls
// fail with ErrClosed.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed, b.objects = true, nil
	return nil
}

// Put implements storage.Backend. It reads r whole, checking ctx between
// blocks, before the new object replaces the old one.
func (b *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	if err := storage.ValidName(name); err != nil {
		return fmt.Errorf("memstore: %w", err)
	}
	data, err := readAll(ctx, r, size)
	if err != nil {
		return fmt.Errorf("memstore: put %q: %w", name, err)
	}
	return b.store("put", name, data, false)
}

// readAll reads r to the end, checking the length against size unless it
// is negative.
func readAll(ctx context.Context, r io.Reader, size int64) ([]byte, error) {
	var buf bytes.Buffer
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		_, err := io.CopyN(&buf, r, readBlock)
		if size >= 0 && int64(buf.Len()) > size {
			return nil, fmt.Errorf("reader yielded more than the %d bytes announced", size)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read: %w", err)
		}
	}
	if size >= 0 && int64(buf.Len()) != size {
		return nil, fmt.Errorf("reader yielded %d bytes, %d announced", buf.Len(), size)
	}
	return buf.Bytes(), nil
}

// PutIfAbsent implements storage.Backend.
func (b *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	if err := storage.ValidName(name); err != nil {
		return fmt.Errorf("memstore: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: put-if-absent %q: %w", name, err)
	}
	return b.store("put-if-absent", name, slices.Clone(data), true)
}

// store publishes data under name; with absent, only if name is free.
func (b *Backend) store(op, name string, data []byte, absent bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("memstore: %s %q: %w", op, name, ErrClosed)
	}
	if _, ok := b.objects[name]; ok && absent {
		return fmt.Errorf("memstore: %s %q: %w", op, name, storage.ErrExists)
	}
	b.objects[name] = object{data: data, modTime: time.Now()}
	return nil
}

// Get implements storage.Backend.
func (b *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	if offset < 0 {
		return nil, fmt.Errorf("memstore: get %q: negative offset %d", name, offset)
	}
	o, err := b.lookup(ctx, "get", name)
	if err != nil {
		return nil, err
	}
	data := o.data[min(offset, int64(len(o.data))):]
	if length >= 0 && length < int64(len(data)) {
		data = data[:length]
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

// Stat implements storage.Backend.
func (b *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	o, err := b.lookup(ctx, "stat", name)
	if err != nil {
		return storage.ObjectInfo{}, err
	}
	return storage.ObjectInfo{Name: name, Size: int64(len(o.data)), ModTime: o.modTime}, nil
}

func (b *Backend) lookup(ctx context.Context, op, name string) (object, error) {
	if err := storage.ValidName(name); err != nil {
		return object{}, fmt.Errorf("memstore: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return object{}, fmt.Errorf("memstore: %s %q: %w", op, name, err)
	}
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.closed {
		return object{}, fmt.Errorf("memstore: %s %q: %w", op, name, ErrClosed)
	}
	o, ok := b.objects[name]
	if !ok {
		return object{}, fmt.Errorf("memstore: %s %q: %w", op, name, storage.ErrNotFound)
	}
	return o, nil
}

// List implements storage.Backend. fn runs on a snapshot taken when List
// starts, without the store locked, so it may call the store.
func (b *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("memstore: list: %w", err)
	}
	infos, err := b.snapshot(ctx, "list", prefix)
	if err != nil {
		return err
	}
	for _, info := range infos {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("memstore: list %q: %w", prefix, err)
		}
		if err := fn(info); err != nil {
			return err
		}
	}
	return nil
}

// snapshot returns the objects whose names start with prefix, in lexical
// order.
func (b *Backend) snapshot(ctx context.Context, op, prefix string) ([]storage.ObjectInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("memstore: %s %q: %w", op, prefix, err)
	}
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.closed {
		return nil, fmt.Errorf("memstore: %s %q: %w", op, prefix, ErrClosed)
	}
	var infos []storage.ObjectInfo
	for name, o := range b.objects {
		if strings.HasPrefix(name, prefix) {
			infos = append(infos, storage.ObjectInfo{Name: name, Size: int64(len(o.data)), ModTime: o.modTime})
		}
	}
	slices.SortFunc(infos, func(x, y storage.ObjectInfo) int { return strings.Compare(x.Name, y.Name) })
	return infos, nil
}

// ListDirs implements storage.Backend.
func (b *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	if err := storage.ValidDir(dir); err != nil {
		return fmt.Errorf("memstore: list dirs: %w", err)
	}
	infos, err := b.snapshot(ctx, "list dirs", dir)
	if err != nil {
		return err
	}
	segs := map[string]bool{}
	for _, info := range infos {
		rest := info.Name[len(dir):]
		if i := strings.IndexByte(rest, '/'); i >= 0 {
			segs[rest[:i+1]] = true
		}
	}
	// Sorted with the slash, the order of S3's common prefixes.
	for _, seg := range slices.Sorted(maps.Keys(segs)) {
		if err := fn(strings.TrimSuffix(seg, "/")); err != nil {
			return err
		}
	}
	return nil
}

// Delete implements storage.Backend.
func (b *Backend) Delete(ctx context.Context, name string) error {
	if err := storage.ValidName(name); err != nil {
		return fmt.Errorf("memstore: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("memstore: delete %q: %w", name, err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("memstore: delete %q: %w", name, ErrClosed)
	}
	delete(b.objects, name)
	return nil
}

// ListTemporaries implements storage.Backend: a Put here holds its bytes
// in memory until it replaces the object at once, so there are none.
func (b *Backend) ListTemporaries(ctx context.Context, prefix string, _ func(storage.Temporary) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("memstore: list temporaries: %w", err)
	}
	_, err := b.snapshot(ctx, "list temporaries", prefix)
	return err
}

// DeleteTemporary implements storage.Backend: there are none to delete,
// so it refuses every t as naming no temporary of this backend's.
func (b *Backend) DeleteTemporary(_ context.Context, t storage.Temporary) error {
	return fmt.Errorf("memstore: delete temporary %q of %q: %w: this store has no temporaries", t.ID, t.Name, storage.ErrInvalidName)
}
