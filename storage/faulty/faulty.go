// Package faulty wraps a storage.Backend to make its operations misbehave
// on demand, for tests of what ckptd does while storage is down, full,
// slow or lying: calls that fail (with storage.ErrUnavailable,
// storage.ErrNoSpace or any error), calls that are delayed, Get bodies that
// end early or come back corrupted, and Puts whose data stream fails after
// some bytes. Each fault applies to chosen operations and names, and is
// added and removed while the code under test runs:
//
//	store := faulty.New(memstore.New())
//	outage := store.Outage(faulty.OpAll) // storage goes away
//	// ... a restore fails with storage.ErrUnavailable ...
//	outage.Remove() // and comes back
//
// With no fault injected the wrapper passes every call through unchanged,
// and it passes the storagetest suite.
package faulty

import (
	"context"
	"fmt"
	"io"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Op is a set of Backend operations.
type Op uint16

// The operations, and sets of them.
const (
	OpPut Op = 1 << iota
	OpPutIfAbsent
	OpGet
	OpStat
	OpList
	OpListDirs
	OpDelete
	OpListTemporaries
	OpDeleteTemporary

	OpWrites = OpPut | OpPutIfAbsent | OpDelete | OpDeleteTemporary
	OpReads  = OpGet | OpStat | OpList | OpListDirs | OpListTemporaries
	OpAll    = OpWrites | OpReads
)

var opNames = []string{"put", "put-if-absent", "get", "stat", "list", "list dirs", "delete", "list temporaries", "delete temporary"}

func (o Op) String() string {
	var names []string
	for i, name := range opNames {
		if o&(1<<i) != 0 {
			names = append(names, name)
		}
	}
	return strings.Join(names, "|")
}

// Kind is what a fault does.
type Kind int

const (
	// Fail makes the call return Err (storage.ErrUnavailable if nil),
	// wrapped, without reaching the wrapped backend.
	Fail Kind = iota
	// Delay makes the call wait Delay, or until its context is done, and
	// then go ahead.
	Delay
	// ShortRead makes a Get's body end after N bytes: with io.EOF, as if
	// the object were shorter, or with Err if set, as if the connection
	// broke.
	ShortRead
	// CorruptRead flips the bits of the byte at offset N of a Get's body
	// (counted from the start of the body, not of the object).
	CorruptRead
	// FailPutAfter makes the data stream of a Put fail with Err
	// (storage.ErrUnavailable if nil) after N bytes, so the wrapped
	// backend's Put fails midway and, by its contract, stores nothing. A
	// Put of N bytes or fewer is not affected.
	FailPutAfter
	// StallPutAfter makes the data stream of a Put stop for Delay (or
	// until the Put's context ends) after N bytes, then go on: the write is
	// in progress, with what it wrote so far in the store's temporary,
	// which is where a crash test kills the writer.
	StallPutAfter
)

// kindOps are the operations each kind can apply to.
var kindOps = map[Kind]Op{Fail: OpAll, Delay: OpAll, ShortRead: OpGet, CorruptRead: OpGet, FailPutAfter: OpPut, StallPutAfter: OpPut}

// Fault describes one misbehaviour and the calls it applies to.
type Fault struct {
	Kind Kind
	// Ops are the operations it applies to; zero means all those its kind
	// can apply to.
	Ops Op
	// Name is a path.Match pattern ("job/steps/*/COMMIT.json") for the
	// object name; List, ListDirs and ListTemporaries match it against
	// their prefix or folder. Empty matches every call.
	Name string
	// Err is the error of Fail, FailPutAfter and ShortRead.
	Err error
	// Delay is the wait of Delay and StallPutAfter.
	Delay time.Duration
	// N is the byte offset of ShortRead, CorruptRead, FailPutAfter and
	// StallPutAfter.
	N int64
	// Times is how many calls it applies to before it stops; zero means
	// until it is removed.
	Times int
}

// Rule is an injected fault; it stays in force until Remove.
type Rule struct {
	fault Fault
	ops   Op
	b     *Backend
	hits  int // guarded by b.mu
}

// Remove ends the fault. Calls already affected by it are not undone.
func (r *Rule) Remove() {
	r.b.mu.Lock()
	defer r.b.mu.Unlock()
	for i, x := range r.b.rules {
		if x == r {
			r.b.rules = append(r.b.rules[:i:i], r.b.rules[i+1:]...)
			return
		}
	}
}

// Hits reports how many calls the fault has applied to.
func (r *Rule) Hits() int {
	r.b.mu.Lock()
	defer r.b.mu.Unlock()
	return r.hits
}

// Backend wraps a storage.Backend with injectable faults. It is safe for
// concurrent use, and faults may be injected and removed at any time.
type Backend struct {
	inner storage.Backend

	mu    sync.Mutex
	rules []*Rule // in injection order
}

var _ storage.Backend = (*Backend)(nil)

// New wraps inner, with no fault injected. Closing the wrapper closes
// inner.
func New(inner storage.Backend) *Backend { return &Backend{inner: inner} }

// Inject adds a fault; it applies to calls that start from now on, after
// the faults injected before it. It panics if f.Name is not a valid
// path.Match pattern, as regexp.MustCompile does with a bad expression.
func (b *Backend) Inject(f Fault) *Rule {
	if _, err := path.Match(f.Name, ""); err != nil {
		panic(fmt.Sprintf("faulty: bad name pattern %q: %v", f.Name, err))
	}
	ops := kindOps[f.Kind]
	if f.Ops != 0 {
		ops &= f.Ops
	}
	r := &Rule{fault: f, ops: ops, b: b}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rules = append(b.rules, r)
	return r
}

// Outage makes every call of ops (all operations if zero) fail with
// storage.ErrUnavailable until the returned rule is removed.
func (b *Backend) Outage(ops Op) *Rule {
	return b.Inject(Fault{Kind: Fail, Ops: ops, Err: storage.ErrUnavailable})
}

// Clear removes every fault.
func (b *Backend) Clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rules = nil
}

// take returns the faults that apply to a call of op on name, in injection
// order, and counts them as applied.
func (b *Backend) take(op Op, name string) []Fault {
	b.mu.Lock()
	defer b.mu.Unlock()
	var faults []Fault
	for _, r := range b.rules {
		if r.ops&op == 0 || r.fault.Times > 0 && r.hits >= r.fault.Times {
			continue
		}
		if ok, _ := path.Match(r.fault.Name, name); r.fault.Name != "" && !ok {
			continue
		}
		r.hits++
		faults = append(faults, r.fault)
	}
	return faults
}

// before applies the faults that act before a call reaches the wrapped
// backend, and returns the others (those on the data) for the call to
// apply.
func (b *Backend) before(ctx context.Context, op Op, name string) ([]Fault, error) {
	var data []Fault
	for _, f := range b.take(op, name) {
		switch f.Kind {
		case Fail:
			return nil, injected(op, name, errOr(f.Err, storage.ErrUnavailable))
		case Delay:
			if err := sleep(ctx, f.Delay); err != nil {
				return nil, fmt.Errorf("faulty: %s %q: delayed: %w", op, name, err)
			}
		default:
			data = append(data, f)
		}
	}
	return data, nil
}

func injected(op Op, name string, err error) error {
	return fmt.Errorf("faulty: %s %q: injected: %w", op, name, err)
}

func errOr(err, def error) error {
	if err == nil {
		return def
	}
	return err
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Location implements storage.Backend: the wrapped backend's.
func (b *Backend) Location() string { return b.inner.Location() }

// Close implements storage.Backend by closing the wrapped backend.
func (b *Backend) Close() error { return b.inner.Close() }

// Put implements storage.Backend.
func (b *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	faults, err := b.before(ctx, OpPut, name)
	if err != nil {
		return err
	}
	for _, f := range faults {
		if f.Kind == StallPutAfter {
			r = &stallingReader{ctx: ctx, r: r, left: f.N, stall: f.Delay}
			continue
		}
		r = &failingReader{r: r, left: f.N, err: injected(OpPut, name, errOr(f.Err, storage.ErrUnavailable))}
	}
	return b.inner.Put(ctx, name, r, size)
}

// PutIfAbsent implements storage.Backend.
func (b *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	if _, err := b.before(ctx, OpPutIfAbsent, name); err != nil {
		return err
	}
	return b.inner.PutIfAbsent(ctx, name, data)
}

// Get implements storage.Backend.
func (b *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	faults, err := b.before(ctx, OpGet, name)
	if err != nil {
		return nil, err
	}
	rc, err := b.inner.Get(ctx, name, offset, length)
	if err != nil {
		return nil, err
	}
	for _, f := range faults {
		end := io.EOF // as if the object ended there
		if f.Err != nil {
			end = injected(OpGet, name, f.Err)
		}
		rc = &body{ReadCloser: rc, fault: f, end: end}
	}
	return rc, nil
}

// Stat implements storage.Backend.
func (b *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	if _, err := b.before(ctx, OpStat, name); err != nil {
		return storage.ObjectInfo{}, err
	}
	return b.inner.Stat(ctx, name)
}

// List implements storage.Backend.
func (b *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	if _, err := b.before(ctx, OpList, prefix); err != nil {
		return err
	}
	return b.inner.List(ctx, prefix, fn)
}

// ListDirs implements storage.Backend.
func (b *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	if _, err := b.before(ctx, OpListDirs, dir); err != nil {
		return err
	}
	return b.inner.ListDirs(ctx, dir, fn)
}

// Delete implements storage.Backend.
func (b *Backend) Delete(ctx context.Context, name string) error {
	if _, err := b.before(ctx, OpDelete, name); err != nil {
		return err
	}
	return b.inner.Delete(ctx, name)
}

// ListTemporaries implements storage.Backend.
func (b *Backend) ListTemporaries(ctx context.Context, prefix string, fn func(storage.Temporary) error) error {
	if _, err := b.before(ctx, OpListTemporaries, prefix); err != nil {
		return err
	}
	return b.inner.ListTemporaries(ctx, prefix, fn)
}

// DeleteTemporary implements storage.Backend; a fault's Name matches
// t.Name.
func (b *Backend) DeleteTemporary(ctx context.Context, t storage.Temporary) error {
	if _, err := b.before(ctx, OpDeleteTemporary, t.Name); err != nil {
		return err
	}
	return b.inner.DeleteTemporary(ctx, t)
}

// stallingReader passes left bytes of r through, stops for stall (or
// until ctx ends, then fails with ctx's error) and passes the rest.
type stallingReader struct {
	ctx   context.Context
	r     io.Reader
	left  int64
	stall time.Duration
}

func (s *stallingReader) Read(p []byte) (int, error) {
	if s.left == 0 {
		s.left = -1
		if err := sleep(s.ctx, s.stall); err != nil {
			return 0, err
		}
	}
	if s.left > 0 && int64(len(p)) > s.left {
		p = p[:s.left]
	}
	n, err := s.r.Read(p)
	if s.left > 0 {
		s.left -= int64(n)
	}
	return n, err
}

// failingReader passes left bytes of r through, then fails with err.
type failingReader struct {
	r    io.Reader
	left int64
	err  error
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.left <= 0 {
		return 0, f.err
	}
	if int64(len(p)) > f.left {
		p = p[:f.left]
	}
	n, err := f.r.Read(p)
	f.left -= int64(n)
	return n, err
}

// body applies a ShortRead or CorruptRead fault to a Get's body.
type body struct {
	io.ReadCloser
	fault Fault
	end   error // ShortRead's error
	off   int64 // bytes read so far
}

func (b *body) Read(p []byte) (int, error) {
	if b.fault.Kind == ShortRead {
		left := b.fault.N - b.off
		if left <= 0 {
			return 0, b.end
		}
		if int64(len(p)) > left {
			p = p[:left]
		}
	}
	n, err := b.ReadCloser.Read(p)
	if i := b.fault.N - b.off; b.fault.Kind == CorruptRead && i >= 0 && i < int64(n) {
		p[i] ^= 0xff
	}
	b.off += int64(n)
	return n, err
}
