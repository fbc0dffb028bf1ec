package posix

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// Options tune a Backend. The zero value writes everything through the page
// cache; New enables direct I/O.
type Options struct {
	// DirectIO writes objects of at least DirectIOThreshold bytes, and those
	// of unknown size, with O_DIRECT where the file system supports it, and
	// falls back to buffered writes where it does not.
	DirectIO bool
	// DirectIOThreshold is the smallest known size written with O_DIRECT;
	// zero means DefaultDirectIOThreshold. Below it the page cache is
	// cheaper than aligned block writes.
	DirectIOThreshold int64
}

// DefaultDirectIOThreshold is the DirectIOThreshold New uses.
const DefaultDirectIOThreshold = 8 << 20

// Backend stores objects as files under a root directory. It is safe for
// concurrent use, also by several processes and nodes sharing the directory.
//
// Memory: every Put or PutIfAbsent in progress holds two BufferSize buffers
// from a shared pool (one being written while the other fills), so write
// memory is bounded by the number of concurrent writes × 2 × BufferSize
// (8 MiB); idle buffers are released by the garbage collector.
type Backend struct {
	root string // absolute and clean
	opts Options

	// How writes went; read by tests, and by metrics later.
	directWrites   atomic.Int64 // writes that turned O_DIRECT on
	directFallback atomic.Int64 // EINVALs that made a write give up O_DIRECT
}

var _ storage.Backend = (*Backend)(nil)

// New returns a Backend rooted at root, creating the directory if missing,
// with direct I/O enabled for large writes.
func New(root string) (*Backend, error) {
	return NewWithOptions(root, Options{DirectIO: true})
}

// NewWithOptions is New with explicit options.
func NewWithOptions(root string, opts Options) (*Backend, error) {
	if root == "" {
		return nil, errors.New("posix: empty root directory")
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("posix: root %q: %w", root, err)
	}
	if err := os.MkdirAll(abs, 0o777); err != nil {
		return nil, fmt.Errorf("posix: create root: %w", err)
	}
	if opts.DirectIOThreshold <= 0 {
		opts.DirectIOThreshold = DefaultDirectIOThreshold
	}
	return &Backend{root: abs, opts: opts}, nil
}

// Root returns the absolute root directory.
func (b *Backend) Root() string { return b.root }

// Location returns the root as a file URL, "file:///abs/path".
func (b *Backend) Location() string {
	return (&url.URL{Scheme: "file", Path: b.root}).String()
}

// Close does nothing: the backend holds no resources between calls.
func (b *Backend) Close() error { return nil }

// Put implements storage.Backend. It stops reading between blocks once ctx
// is done, but cannot interrupt a Read that blocks.
func (b *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	p, err := b.path(name)
	if err != nil {
		return err
	}
	if err := b.put(ctx, p, r, size); err != nil {
		return wrapErr("put", name, err)
	}
	return nil
}

func (b *Backend) put(ctx context.Context, p string, r io.Reader, size int64) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, err := b.createTemp(p)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			t.abort()
		}
	}()
	if err := b.writeFile(ctx, t.f, r, size); err != nil {
		return err
	}
	if err := t.closeSynced(); err != nil {
		return err
	}
	if err := os.Rename(t.path, p); err != nil {
		return err
	}
	t.path = "" // renamed: nothing left to clean up
	return t.syncDirs()
}

// PutIfAbsent implements storage.Backend.
//
// On file systems without hard links (link(2) fails with EPERM or
// EOPNOTSUPP) it falls back to creating the name with O_EXCL and writing into
// it. That is still exclusive, but not atomic for contents: a reader can see
// a partly written object, and a crash can leave one behind.
func (b *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	p, err := b.path(name)
	if err != nil {
		return err
	}
	if err := b.putIfAbsent(ctx, p, data); err != nil {
		return wrapErr("put-if-absent", name, err)
	}
	return nil
}

func (b *Backend) putIfAbsent(ctx context.Context, p string, data []byte) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, err := b.createTemp(p)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			t.abort()
		}
	}()
	size := int64(len(data))
	if err := b.writeFile(ctx, t.f, bytes.NewReader(data), size); err != nil {
		return err
	}
	if err := t.closeSynced(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	err = link(t.path, p)
	if isLinkUnsupported(err) {
		err = createExclusive(p, data)
	}
	if errors.Is(err, fs.ErrExist) {
		return storage.ErrExists
	}
	if err != nil {
		return err
	}
	// Remove the temporary name before syncing, so one directory fsync
	// makes both the new link and the removal durable.
	_ = os.Remove(t.path)
	t.path = ""
	return t.syncDirs()
}

// link is os.Link; tests replace it to simulate a file system without
// hard links.
var link = os.Link

func isLinkUnsupported(err error) bool {
	return errors.Is(err, unix.EPERM) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP)
}

// createExclusive is PutIfAbsent's fallback for file systems without hard
// links; see PutIfAbsent.
func createExclusive(p string, data []byte) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o666)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(p)
	}
	return err
}

// Get implements storage.Backend. The reader reads the object as it was when
// Get opened it, even if a Put replaces it meanwhile.
func (b *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	p, err := b.path(name)
	if err != nil {
		return nil, err
	}
	if offset < 0 {
		return nil, fmt.Errorf("posix: get %q: negative offset %d", name, offset)
	}
	if err := ctx.Err(); err != nil {
		return nil, wrapErr("get", name, err)
	}
	f, size, err := openObject(p)
	if err != nil {
		return nil, notFoundOr("get", name, err)
	}
	if offset >= size {
		_ = f.Close()
		return io.NopCloser(bytes.NewReader(nil)), nil
	}
	n := size - offset
	if length >= 0 && length < n {
		n = length
	}
	return &sectionFile{SectionReader: io.NewSectionReader(f, offset, n), f: f}, nil
}

// openObject opens p for reading and returns its size; a directory or other
// non-regular file is reported as fs.ErrNotExist.
func openObject(p string) (*os.File, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = &fs.PathError{Op: "open", Path: p, Err: fs.ErrNotExist}
	}
	if err != nil {
		_ = f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}

type sectionFile struct {
	*io.SectionReader
	f *os.File
}

func (s *sectionFile) Close() error { return s.f.Close() }

// Stat implements storage.Backend.
func (b *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	p, err := b.path(name)
	if err != nil {
		return storage.ObjectInfo{}, err
	}
	if err := ctx.Err(); err != nil {
		return storage.ObjectInfo{}, wrapErr("stat", name, err)
	}
	fi, err := os.Stat(p)
	if err == nil && !fi.Mode().IsRegular() {
		err = &fs.PathError{Op: "stat", Path: p, Err: fs.ErrNotExist}
	}
	if err != nil {
		return storage.ObjectInfo{}, notFoundOr("stat", name, err)
	}
	return storage.ObjectInfo{Name: name, Size: fi.Size(), ModTime: fi.ModTime()}, nil
}

// Delete implements storage.Backend. It then removes the directories that
// became empty, up to but not including the root; a concurrent Put that
// needs one of them again recreates it.
func (b *Backend) Delete(ctx context.Context, name string) error {
	p, err := b.path(name)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return wrapErr("delete", name, err)
	}
	// unlink(2), not os.Remove: that would also remove an empty directory
	// of the same name, which is not an object.
	if err := unix.Unlink(p); err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EISDIR) {
			return nil // no such object (a directory is not one)
		}
		return wrapErr("delete", name, &fs.PathError{Op: "unlink", Path: p, Err: err})
	}
	b.removeEmptyDirs(filepath.Dir(p))
	return nil
}

// removeEmptyDirs removes dir and its ancestors below the root while they
// are empty; rmdir(2) refuses non-empty ones, so this is safe against
// concurrent writers.
func (b *Backend) removeEmptyDirs(dir string) {
	for len(dir) > len(b.root) {
		if err := unix.Rmdir(dir); err != nil {
			return
		}
		dir = filepath.Dir(dir)
	}
}

// path validates name and returns its file path.
func (b *Backend) path(name string) (string, error) {
	if err := storage.ValidName(name); err != nil {
		return "", fmt.Errorf("posix: %w", err)
	}
	if isTempName(lastSegment(name)) {
		return "", fmt.Errorf("posix: %w %q: reserved for temporary files", storage.ErrInvalidName, name)
	}
	return filepath.Join(b.root, filepath.FromSlash(name)), nil
}

// wrapErr names the operation and object, and adds storage.ErrNoSpace to
// out-of-space errors so callers can tell a full store from a broken one.
func wrapErr(op, name string, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return fmt.Errorf("posix: %s %q: %w: %w", op, name, storage.ErrNoSpace, err)
	}
	return fmt.Errorf("posix: %s %q: %w", op, name, err)
}

// notFoundOr turns a missing file (or a missing or non-directory parent)
// into storage.ErrNotFound and wraps anything else.
func notFoundOr(op, name string, err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("posix: %s %q: %w", op, name, storage.ErrNotFound)
	}
	return wrapErr(op, name, err)
}
