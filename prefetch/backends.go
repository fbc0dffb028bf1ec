package prefetch

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Defaults of the backend pool.
const (
	DefaultMaxBackends = 64
	DefaultBackendIdle = 30 * time.Second
)

// backendPool keeps the backends of dataset sources open while sessions
// use them: one per source, shared by the sessions reading it, closed
// once unused for idleAfter, and never more than max open (or opening) at
// once. A source that fails to open, or whose dataset fails to list, is
// released at once, so a stream of bad sources holds nothing.
type backendPool struct {
	max       int
	idleAfter time.Duration
	now       func() time.Time

	mu      sync.Mutex
	open    map[string]*backendRef
	opening int // opens in flight, counted against max
	closed  bool
}

type backendRef struct {
	key  string
	b    storage.Backend
	refs int
	idle time.Time // when refs last fell to 0
}

func newBackendPool(max int, idleAfter time.Duration) *backendPool {
	if max <= 0 {
		max = DefaultMaxBackends
	}
	if idleAfter <= 0 {
		idleAfter = DefaultBackendIdle
	}
	return &backendPool{max: max, idleAfter: idleAfter, now: time.Now, open: map[string]*backendRef{}}
}

// acquire returns the backend of key, opening it with open on first use.
// The open runs without the lock: against an unreachable store it retries
// for the retry deadline, and other sessions must not wait on it. The
// caller releases the reference.
func (p *backendPool) acquire(ctx context.Context, key string, open func(context.Context) (storage.Backend, error)) (*backendRef, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	if br := p.open[key]; br != nil {
		br.refs++
		p.mu.Unlock()
		return br, nil
	}
	victims := p.makeRoom()
	if len(p.open)+p.opening >= p.max {
		p.mu.Unlock()
		closeAll(victims)
		return nil, fmt.Errorf("%w: %d dataset sources are in use at once, the most the daemon keeps open; close some datasets",
			ErrOverBudget, p.max)
	}
	p.opening++
	p.mu.Unlock()
	closeAll(victims)

	b, err := open(ctx)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.opening--
	switch {
	case err != nil:
		return nil, err
	case p.closed:
		b.Close()
		return nil, ErrClosed
	}
	if first := p.open[key]; first != nil { // opened meanwhile by another session
		b.Close()
		first.refs++
		return first, nil
	}
	br := &backendRef{key: key, b: b, refs: 1}
	p.open[key] = br
	return br, nil
}

// makeRoom takes the least recently used idle backends out of the pool
// while it is full, and returns them to close (without the lock).
func (p *backendPool) makeRoom() []storage.Backend {
	if len(p.open)+p.opening < p.max {
		return nil
	}
	var idle []*backendRef
	for _, br := range p.open {
		if br.refs == 0 {
			idle = append(idle, br)
		}
	}
	slices.SortFunc(idle, func(a, b *backendRef) int { return a.idle.Compare(b.idle) })
	var out []storage.Backend
	for _, br := range idle {
		if len(p.open)+p.opening < p.max {
			break
		}
		delete(p.open, br.key)
		out = append(out, br.b)
	}
	return out
}

// release drops a reference taken by acquire.
func (p *backendPool) release(br *backendRef) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if br.refs--; br.refs == 0 {
		br.idle = p.now()
	}
}

// reap closes the backends unused for idleAfter.
func (p *backendPool) reap() {
	p.mu.Lock()
	var out []storage.Backend
	now := p.now()
	for key, br := range p.open {
		if br.refs == 0 && now.Sub(br.idle) >= p.idleAfter {
			delete(p.open, key)
			out = append(out, br.b)
		}
	}
	p.mu.Unlock()
	closeAll(out)
}

// len is how many backends are open or opening.
func (p *backendPool) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.open) + p.opening
}

// close closes every backend; later acquires fail with ErrClosed.
func (p *backendPool) close() {
	p.mu.Lock()
	p.closed = true
	var out []storage.Backend
	for _, br := range p.open {
		out = append(out, br.b)
	}
	p.open = map[string]*backendRef{}
	p.mu.Unlock()
	closeAll(out)
}

func closeAll(bs []storage.Backend) {
	for _, b := range bs {
		b.Close()
	}
}

// openError classifies a failed open of a source's backend: an unreachable
// store is reported as such (storage.ErrUnavailable), as is a cancelled
// call; any other failure means the source is wrong (ErrInvalid).
func openError(ctx context.Context, source string, err error) error {
	if errors.Is(err, storage.ErrUnavailable) || ctx.Err() != nil {
		return fmt.Errorf("dataset source %q: %w", source, err)
	}
	return fmt.Errorf("%w: dataset source %q: %w", ErrInvalid, source, err)
}
