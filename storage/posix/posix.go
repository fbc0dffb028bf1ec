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
	"time"

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
	// FileMode is the mode of the objects the backend writes, exactly,
	// whatever the process's umask; zero means DefaultFileMode. Folders it
	// creates get the same bits plus search (x) wherever read is allowed,
	// so 0640 gives 0750 and 0644 gives 0755. ValidFileMode says which
	// modes are accepted.
	FileMode fs.FileMode
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
	root    string   // absolute and clean, as configured (for messages)
	rootDir *os.File // the root, opened once; every path is resolved from it
	openat2 bool     // the kernel resolves whole paths safely
	opts    Options
	// The modes of new files and folders, as mode_t bits.
	fileMode, dirMode uint32

	// How writes went, for the tests that check which path a write took
	// (O_DIRECT or buffered).
	directWrites   atomic.Int64 // writes that turned O_DIRECT on
	directFallback atomic.Int64 // EINVALs that made a write give up O_DIRECT
}

var _ storage.Backend = (*Backend)(nil)

// New returns a Backend rooted at root, creating the directory if missing,
// with direct I/O enabled for large writes.
func New(root string) (*Backend, error) {
	return NewWithOptions(root, Options{DirectIO: true})
}

// NewWithOptions is New with explicit options. The root itself may be, or
// lie below, a symbolic link: it is resolved once, here. Links below it
// are never followed. The caller closes the backend.
func NewWithOptions(root string, opts Options) (*Backend, error) {
	if root == "" {
		return nil, errors.New("posix: empty root directory")
	}
	if opts.FileMode == 0 {
		opts.FileMode = DefaultFileMode
	}
	if err := ValidFileMode(opts.FileMode); err != nil {
		return nil, fmt.Errorf("posix: %w", err)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("posix: root %q: %w", root, err)
	}
	dirMode := folderMode(opts.FileMode)
	if err := makeRoot(abs, dirMode); err != nil {
		return nil, fmt.Errorf("posix: create root: %w", err)
	}
	rootDir, withOpenat2, err := openRoot(abs)
	if err != nil {
		return nil, fmt.Errorf("posix: %w", err)
	}
	if opts.DirectIOThreshold <= 0 {
		opts.DirectIOThreshold = DefaultDirectIOThreshold
	}
	return &Backend{
		root: abs, rootDir: rootDir, openat2: withOpenat2, opts: opts,
		fileMode: uint32(opts.FileMode), dirMode: uint32(dirMode),
	}, nil
}

// makeRoot creates the root if it is missing, with the folder mode; the
// folders above it, if it makes any, get the same.
func makeRoot(abs string, mode fs.FileMode) error {
	if _, err := os.Stat(abs); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return nil // there, or openRoot will say what is wrong
	}
	if err := os.MkdirAll(abs, mode); err != nil {
		return err
	}
	return os.Chmod(abs, mode) // MkdirAll's mode is cut by the umask
}

// Root returns the absolute root directory.
func (b *Backend) Root() string { return b.root }

// Location returns the root as a file URL, "file:///abs/path".
func (b *Backend) Location() string {
	return (&url.URL{Scheme: "file", Path: b.root}).String()
}

// Close releases the root's descriptor; calls in progress finish first,
// and later calls fail.
func (b *Backend) Close() error {
	if err := b.rootDir.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return fmt.Errorf("posix: close: %w", err)
	}
	return nil
}

// Put implements storage.Backend. It stops reading between blocks once ctx
// is done, but cannot interrupt a Read that blocks.
func (b *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	if err := b.check(name); err != nil {
		return err
	}
	if err := b.put(ctx, name, r, size); err != nil {
		return wrapErr("put", name, err)
	}
	return nil
}

func (b *Backend) put(ctx context.Context, name string, r io.Reader, size int64) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, err := b.createTemp(name, false)
	if err != nil {
		return err
	}
	defer t.finish(&err)
	if err := b.writeFile(ctx, t.f, r, size); err != nil {
		return err
	}
	if err := t.closeSynced(); err != nil {
		return err
	}
	if err := t.rename(); err != nil {
		return err
	}
	return t.syncDirs()
}

// Get implements storage.Backend. The reader reads the object as it was when
// Get opened it, even if a Put replaces it meanwhile.
func (b *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	if err := b.check(name); err != nil {
		return nil, err
	}
	if offset < 0 {
		return nil, fmt.Errorf("posix: get %q: negative offset %d", name, offset)
	}
	if err := ctx.Err(); err != nil {
		return nil, wrapErr("get", name, err)
	}
	f, size, err := b.openObject(name)
	if errors.Is(err, ErrNotRegular) {
		err = unix.ENOENT // a folder or a FIFO where an object should be: no object
	}
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

// openObject opens the object for reading and returns its size: its
// folder resolved beneath the root through no link (openDir), then the
// object with O_NOFOLLOW. A link is a *linkError; a folder or other
// non-regular file ErrNotRegular, closed before anything is read from it.
// O_NONBLOCK keeps a FIFO planted in the store from blocking the open, and
// O_NOCTTY a tty from becoming the daemon's terminal; the regular file
// gets blocking reads back.
func (b *Backend) openObject(name string) (*os.File, int64, error) {
	dir, base := splitName(name)
	dfd, err := b.openDir(dir, pathFlags)
	if err != nil {
		return nil, 0, err
	}
	fd, err := unix.Openat(dfd, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	closeFD(dfd)
	if err != nil {
		return nil, 0, objectErr("open", b.abs(name), name, err)
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	if err == nil && fileType(&st) != unix.S_IFREG {
		err = fmt.Errorf("%w (%s)", ErrNotRegular, kind(&st))
	}
	if err == nil {
		err = unix.SetNonblock(fd, false)
	}
	if err != nil {
		closeFD(fd)
		return nil, 0, &fs.PathError{Op: "open", Path: b.abs(name), Err: err}
	}
	return os.NewFile(uintptr(fd), b.abs(name)), st.Size, nil
}

// objectErr wraps an error from a call on the object's last segment with
// O_NOFOLLOW, which fails with ELOOP on a link.
func objectErr(op, path, name string, err error) error {
	if errors.Is(err, unix.ELOOP) {
		return &linkError{link: name}
	}
	return &fs.PathError{Op: op, Path: path, Err: err}
}

type sectionFile struct {
	*io.SectionReader
	f *os.File
}

func (s *sectionFile) Close() error { return s.f.Close() }

// Stat implements storage.Backend.
func (b *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	if err := b.check(name); err != nil {
		return storage.ObjectInfo{}, err
	}
	if err := ctx.Err(); err != nil {
		return storage.ObjectInfo{}, wrapErr("stat", name, err)
	}
	st, err := b.lstat(name)
	if err == nil && fileType(&st) != unix.S_IFREG {
		err = &fs.PathError{Op: "stat", Path: b.abs(name), Err: fs.ErrNotExist}
	}
	if err != nil {
		return storage.ObjectInfo{}, notFoundOr("stat", name, err)
	}
	return objectInfo(name, &st), nil
}

// lstat returns the metadata of the file at name; a link fails with a
// *linkError.
func (b *Backend) lstat(name string) (unix.Stat_t, error) {
	dir, base := splitName(name)
	dfd, err := b.openDir(dir, pathFlags)
	if err != nil {
		return unix.Stat_t{}, err
	}
	defer closeFD(dfd)
	st, err := statAt(dfd, base)
	if err != nil {
		return st, &fs.PathError{Op: "stat", Path: b.abs(name), Err: err}
	}
	if fileType(&st) == unix.S_IFLNK {
		return st, &linkError{link: name}
	}
	return st, nil
}

func objectInfo(name string, st *unix.Stat_t) storage.ObjectInfo {
	return storage.ObjectInfo{Name: name, Size: st.Size, ModTime: time.Unix(st.Mtim.Unix())}
}

// Delete implements storage.Backend. It then removes the folders that
// became empty, up to but not including the root; a concurrent Put that
// needs one of them again recreates it. A link at name is refused, not
// removed: it is a sign of tampering for the operator to look at.
func (b *Backend) Delete(ctx context.Context, name string) error {
	if err := b.check(name); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return wrapErr("delete", name, err)
	}
	dir, base := splitName(name)
	dfd, err := b.openDir(dir, pathFlags)
	if err == nil {
		defer closeFD(dfd)
		err = b.unlinkObject(dfd, name, base)
	}
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EISDIR) {
		return nil // no such object (a folder is not one)
	}
	if err != nil {
		return wrapErr("delete", name, err)
	}
	b.removeEmptyDirs(dir)
	return nil
}

// unlinkObject removes base from dfd unless it is a link. unlinkat(2)
// without AT_REMOVEDIR, unlike os.Remove, never removes a folder of the
// same name, which is not an object.
func (b *Backend) unlinkObject(dfd int, name, base string) error {
	if isLink(dfd, base) {
		return &linkError{link: name}
	}
	if err := unix.Unlinkat(dfd, base, 0); err != nil {
		return &fs.PathError{Op: "unlink", Path: b.abs(name), Err: err}
	}
	return nil
}

// removeEmptyDirs removes the folder dir and its ancestors below the root
// while they are empty; rmdir refuses non-empty ones, so this is safe
// against concurrent writers, and refuses links (ENOTDIR), so it never
// reaches outside the root.
func (b *Backend) removeEmptyDirs(dir string) {
	for dir != "" {
		parent, base := splitName(dir)
		pfd, err := b.openDir(parent, pathFlags)
		if err != nil {
			return
		}
		err = unix.Unlinkat(pfd, base, unix.AT_REMOVEDIR)
		closeFD(pfd)
		if err != nil {
			return
		}
		dir = parent
	}
}

// check validates name.
func (b *Backend) check(name string) error {
	if err := storage.ValidName(name); err != nil {
		return fmt.Errorf("posix: %w", err)
	}
	if isTempName(lastSegment(name)) {
		return fmt.Errorf("posix: %w %q: reserved for temporary files", storage.ErrInvalidName, name)
	}
	return nil
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
