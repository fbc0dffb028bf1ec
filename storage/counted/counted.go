// Package counted wraps a storage.Backend to report each of its
// operations that failed, in the manner of restic's backend decorators:
// ckptd serve counts the failures of its checkpoint store and of its
// dataset sources this way (ckptd status, ckptd_backend_errors_total).
// It also counts every call by operation (Calls), which tests use to
// bound what an algorithm asks of the store, and the bytes its Gets
// returned (ReadBytes; OnRead reports them as they are read).
//
// An operation failed when the store did not do what was asked. Answers
// are not failures: ErrNotFound (Stat, Get), ErrExists (PutIfAbsent); nor
// is a name refused before the store is touched (ErrInvalidName), a caller
// that gave up (context.Canceled), or an error that a List callback
// returned to stop the listing. A Get whose body breaks off while being
// read counts once, as a failed get.
package counted

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"

	"github.com/ckptd/ckptd/storage"
)

// The operations, as failed reports them.
const (
	OpPut         = "put"
	OpPutIfAbsent = "put-if-absent"
	OpGet         = "get"
	OpStat        = "stat"
	OpList        = "list"
	OpListDirs    = "list-dirs"
	OpDelete      = "delete"
	OpListTemps   = "list-temporaries"
	OpDeleteTemp  = "delete-temporary"
)

var ops = [...]string{OpPut, OpPutIfAbsent, OpGet, OpStat, OpList, OpListDirs, OpDelete, OpListTemps, OpDeleteTemp}

// Backend passes every call through to the backend it wraps and calls
// failed with the operation's name when it failed.
type Backend struct {
	b      storage.Backend
	failed func(op string)
	calls  [len(ops)]atomic.Int64
	read   atomic.Int64
	onRead func(n int64)
}

// New wraps b; failed (nil: none) is called (from any goroutine) once per
// failed operation.
func New(b storage.Backend, failed func(op string)) *Backend {
	if failed == nil {
		failed = func(string) {}
	}
	return &Backend{b: b, failed: failed}
}

// OnRead sets a function (nil: none) called, from any goroutine, with
// the bytes of each read of a Get's body; it returns c. Set it before c
// is used.
func (c *Backend) OnRead(f func(n int64)) *Backend {
	c.onRead = f
	return c
}

// ReadBytes returns the bytes the bodies of c's Gets returned so far.
func (c *Backend) ReadBytes() int64 { return c.read.Load() }

// Calls returns how many times each operation was called so far, failed
// or not, by the names above (those never called are left out). A call
// is not a request: a listing counts once however many pages the store
// answered it in, and a Put once however many parts it was sent in.
func (c *Backend) Calls() map[string]int64 {
	out := map[string]int64{}
	for i, op := range ops {
		if n := c.calls[i].Load(); n > 0 {
			out[op] = n
		}
	}
	return out
}

func (c *Backend) call(op string) {
	for i, o := range ops {
		if o == op {
			c.calls[i].Add(1)
			return
		}
	}
}

// Unwrap returns the wrapped backend, for code that looks for a concrete
// one beneath its decorators.
func (c *Backend) Unwrap() storage.Backend { return c.b }

// Failure reports whether err says the store failed, rather than answered
// or was not asked (see the package comment).
func Failure(err error) bool {
	return err != nil && !errors.Is(err, storage.ErrNotFound) && !errors.Is(err, storage.ErrExists) &&
		!errors.Is(err, storage.ErrInvalidName) && !errors.Is(err, context.Canceled)
}

func (c *Backend) count(op string, err error) error {
	c.call(op)
	if Failure(err) {
		c.failed(op)
	}
	return err
}

func (c *Backend) Location() string { return c.b.Location() }

func (c *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	return c.count(OpPut, c.b.Put(ctx, name, r, size))
}

func (c *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	return c.count(OpPutIfAbsent, c.b.PutIfAbsent(ctx, name, data))
}

func (c *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	rc, err := c.b.Get(ctx, name, offset, length)
	if err != nil {
		return nil, c.count(OpGet, err)
	}
	c.call(OpGet)
	return &body{ReadCloser: rc, c: c}, nil
}

func (c *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	oi, err := c.b.Stat(ctx, name)
	return oi, c.count(OpStat, err)
}

func (c *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	return listing(c, OpList, fn, func(fn func(storage.ObjectInfo) error) error { return c.b.List(ctx, prefix, fn) })
}

func (c *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	return listing(c, OpListDirs, fn, func(fn func(string) error) error { return c.b.ListDirs(ctx, dir, fn) })
}

// listing runs a listing of op with the callback fn and counts its error,
// unless fn's own error stopped it.
func listing[T any](c *Backend, op string, fn func(T) error, list func(func(T) error) error) error {
	stopped := false
	err := list(func(v T) error {
		err := fn(v)
		stopped = err != nil
		return err
	})
	if stopped {
		c.call(op)
		return err // the caller's own error, not the store's
	}
	return c.count(op, err)
}

func (c *Backend) Delete(ctx context.Context, name string) error {
	return c.count(OpDelete, c.b.Delete(ctx, name))
}

func (c *Backend) ListTemporaries(ctx context.Context, prefix string, fn func(storage.Temporary) error) error {
	return listing(c, OpListTemps, fn, func(fn func(storage.Temporary) error) error { return c.b.ListTemporaries(ctx, prefix, fn) })
}

func (c *Backend) DeleteTemporary(ctx context.Context, t storage.Temporary) error {
	return c.count(OpDeleteTemp, c.b.DeleteTemporary(ctx, t))
}

func (c *Backend) Close() error { return c.b.Close() }

// body counts a Get whose body fails while it is read: a connection
// reset, a disk error. Reading to the end (io.EOF) is no failure.
type body struct {
	io.ReadCloser
	c    *Backend
	once sync.Once
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.c.read.Add(int64(n))
		if b.c.onRead != nil {
			b.c.onRead(int64(n))
		}
	}
	if err != nil && !errors.Is(err, io.EOF) && Failure(err) {
		b.once.Do(func() { b.c.failed(OpGet) })
	}
	return n, err
}
