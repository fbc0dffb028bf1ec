// Package storage defines the object store that checkpoints and datasets
// live in. Its implementations are storage/posix (a directory on a local
// disk, NFS or Lustre) and storage/s3 (any S3-compatible store); for tests,
// storage/memstore keeps objects in memory and storage/faulty wraps any
// backend to inject failures.
//
// The interface is deliberately small and context-first, in the manner of
// restic's backend: everything ckptd needs is expressible as whole-object
// puts, ranged gets, prefix listing, stat, delete and one conditional create.
// Each implementation handles its own transient failures where it knows
// them best (storage/s3 retries throttling, 5xx and resets up to a deadline,
// then reports ErrUnavailable); the callers decide what to do after that.
//
// Object names are slash-separated relative keys such as
// "job/steps/000000009000/rank-00000.data". ValidName says which names are
// acceptable; every implementation rejects the rest with ErrInvalidName
// before touching storage.
package storage

import (
	"context"
	"errors"
	"io"
	"time"
)

// Errors every Backend returns (wrapped) so callers can match them with
// errors.Is without knowing the implementation.
var (
	// ErrNotFound: the object does not exist.
	ErrNotFound = errors.New("object not found")
	// ErrExists: PutIfAbsent found the object already there.
	ErrExists = errors.New("object already exists")
	// ErrInvalidName: the name is empty, absolute, has "." or ".." or empty
	// segments, a NUL byte, or a segment longer than 255 bytes.
	ErrInvalidName = errors.New("invalid object name")
	// ErrNoSpace: the store is out of space (ENOSPC, quota).
	ErrNoSpace = errors.New("storage full")
	// ErrUnavailable: the store could not be reached, or kept failing
	// transiently (5xx, throttling, resets) past the retry deadline. The
	// request may succeed later; nothing about it was wrong.
	ErrUnavailable = errors.New("storage unavailable")
	// ErrSymlink: a directory store holds a symbolic link where the name
	// leads (the object itself, or a folder above it). Backends never follow
	// links below their root, so that a link planted in a shared store
	// cannot make the daemon read, replace or delete files outside it.
	ErrSymlink = errors.New("symbolic link in the store")
)

// ObjectInfo describes a stored object.
type ObjectInfo struct {
	Name    string // full name, as passed to Put
	Size    int64
	ModTime time.Time
}

// Temporary is what a Put leaves in the store while it writes, and what a
// writer that died mid-Put (a kill -9, a crash of its node) leaves for
// good: a POSIX backend's temporary file, an S3 multipart upload neither
// completed nor aborted. It is not an object: Get, Stat and List never see
// it, and only ListTemporaries and DeleteTemporary touch it.
type Temporary struct {
	// Name is the object it would become; a POSIX backend recovers it from
	// the temporary file's name, which keeps at most 255 bytes of the last
	// segment.
	Name string
	// ID says which write of that object it is: the temporary file's name,
	// the upload's id. It is opaque outside its backend.
	ID string
	// Size is how many bytes were written so far.
	Size int64
	// ModTime is when it was last written to: a write in progress keeps
	// it fresh, a dead writer's stops. Deciding from it that a temporary
	// is abandoned needs a margin longer than a writer can stall.
	ModTime time.Time
}

// Backend is an object store. Implementations are safe for concurrent use.
type Backend interface {
	// Location names the store for messages ("file:///data/ckpt", "s3://b/p").
	Location() string

	// Put stores the bytes read from r under name, replacing any object of
	// that name. size is the exact length when known, or -1; a reader that
	// yields a different number of bytes than a non-negative size is an
	// error. Put is atomic: readers see the old object or the whole new one,
	// never a part, and when Put returns nil the object is durable. On any
	// error (including ctx cancellation) nothing of the new object remains.
	// Put streams: it never holds the whole object in memory.
	Put(ctx context.Context, name string, r io.Reader, size int64) error

	// PutIfAbsent stores data under name only if no object of that name
	// exists, atomically with respect to concurrent callers on any node
	// sharing the store: of several racing callers exactly one gets nil and
	// the others get ErrExists. Like Put it is atomic: readers, and a crash
	// at any moment, see no object or the whole of data, never a part. The
	// object is durable when it returns nil.
	PutIfAbsent(ctx context.Context, name string, data []byte) error

	// Get returns length bytes of the object starting at offset; length < 0
	// reads to the end. Reading past the end returns fewer bytes (the reader
	// hits io.EOF early), an offset beyond the end an empty reader. The
	// caller closes the reader.
	Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error)

	// Stat returns the object's info or ErrNotFound.
	Stat(ctx context.Context, name string) (ObjectInfo, error)

	// List calls fn for every object whose name starts with prefix, in
	// lexical order of name. Objects being written by Put are not listed.
	// An error from fn stops the listing and is returned.
	List(ctx context.Context, prefix string, fn func(ObjectInfo) error) error

	// ListDirs calls fn with each name segment seg for which some object
	// is named dir+seg+"/…": S3's common prefixes with delimiter "/".
	// dir is "" or ends in "/". The order is lexical by seg+"/" (the order
	// of the common prefixes), so "a-b" comes before "a". It lists
	// directories without reading the objects below them, which is what
	// keeps `ckptd list` cheap on a bucket with millions of chunks. A
	// directory holding only objects being written by Put is not listed.
	// An error from fn stops the listing and is returned.
	ListDirs(ctx context.Context, dir string, fn func(seg string) error) error

	// Delete removes the object. Deleting a missing object succeeds, as an
	// S3 DELETE does: a retried or concurrent delete is not an error, and
	// the object store needs no lookup first.
	Delete(ctx context.Context, name string) error

	// ListTemporaries calls fn for every Temporary of an object whose name
	// starts with prefix, in no particular order: the Puts in progress and
	// what writers that died left. A backend whose Put leaves nothing
	// behind lists none. It cannot tell a live writer's temporary from a
	// dead one's; the caller decides from ModTime. An error from fn stops
	// the listing and is returned.
	ListTemporaries(ctx context.Context, prefix string, fn func(Temporary) error) error

	// DeleteTemporary removes a temporary that ListTemporaries gave, and
	// never the object t.Name itself. A Put still writing to it fails (and
	// stores nothing). Deleting one that is gone (published, aborted,
	// removed) succeeds; a t that names no temporary of this backend's form
	// fails with ErrInvalidName.
	DeleteTemporary(ctx context.Context, t Temporary) error

	// Close releases resources held by the backend.
	Close() error
}
