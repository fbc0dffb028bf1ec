package codec

import "sync"

// freeList hands out reusable values, creating them on demand. Unlike
// sync.Pool it keeps them across garbage collections, which matters for
// zstd coders that carry megabytes of tables and history, and it hands back
// the most recently returned one first, so the number of values that ever
// get touched (and so their memory) follows the peak number of concurrent
// callers rather than GOMAXPROCS.
type freeList[T any] struct {
	mu    sync.Mutex
	free  []T
	fresh func() (T, error)
}

func (l *freeList[T]) get() (T, error) {
	l.mu.Lock()
	if n := len(l.free); n > 0 {
		v := l.free[n-1]
		var zero T
		l.free[n-1] = zero
		l.free = l.free[:n-1]
		l.mu.Unlock()
		return v, nil
	}
	l.mu.Unlock()
	return l.fresh()
}

func (l *freeList[T]) put(v T) {
	l.mu.Lock()
	l.free = append(l.free, v)
	l.mu.Unlock()
}
