package posix

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// ErrNotRegular: OpenBeneath found something other than a regular file
// (a folder, a FIFO, a device, a socket) where a file was expected.
var ErrNotRegular = errors.New("not a regular file")

// LinkError: OpenBeneath met a symbolic link at Link (relative to the
// root). It matches storage.ErrSymlink.
type LinkError struct{ Link string }

func (e *LinkError) Error() string {
	return fmt.Sprintf("%q is a symbolic link, and links are not followed", e.Link)
}

func (e *LinkError) Unwrap() error { return storage.ErrSymlink }

// readFlags open a file that may no longer be what a listing saw: a FIFO
// swapped in does not block the open, a tty does not become the process's
// terminal, and a link in the last place fails with ELOOP.
const readFlags = unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC

// OpenBeneath opens the regular file name (a valid name) for reading,
// resolved the way every path of the backend is: from the root's
// descriptor, beneath it, through no symbolic link -- one
// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) where the kernel has it,
// else the folder-by-folder walk. It is for files the backend did not
// write (a dataset's shards), which may have been swapped since they were
// listed. A link anywhere on the way fails with a *LinkError naming it; a
// file of another type with ErrNotRegular, closed again before anything
// is read from it; a missing file or folder with fs.ErrNotExist.
func (b *Backend) OpenBeneath(name string) (*os.File, error) {
	if err := storage.ValidName(name); err != nil {
		return nil, fmt.Errorf("posix: %w", err)
	}
	fd, err := b.openBeneath(name)
	var le *linkError
	if errors.As(err, &le) {
		return nil, &LinkError{Link: le.link}
	}
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	if err == nil && fileType(&st) != unix.S_IFREG {
		err = fmt.Errorf("%w (%s)", ErrNotRegular, kind(&st))
	}
	if err == nil {
		err = unix.SetNonblock(fd, false) // a regular file: reads block as usual
	}
	if err != nil {
		closeFD(fd)
		return nil, &fs.PathError{Op: "open", Path: b.abs(name), Err: err}
	}
	return os.NewFile(uintptr(fd), b.abs(name)), nil
}

func (b *Backend) openBeneath(name string) (int, error) {
	if !b.openat2 {
		return b.walkOpen(name)
	}
	fd := -1
	var err error
	if rerr := b.withRoot(func(root int) error { fd, err = openat2Retry(root, name); return nil }); rerr != nil {
		return -1, rerr
	}
	switch {
	case err == nil:
		return fd, nil
	case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.ELOOP):
		// Renames kept racing with the lookup, or a link is on the way
		// (the walk finds which, for the message): the walk is as safe.
		return b.walkOpen(name)
	}
	return -1, &fs.PathError{Op: "open", Path: b.abs(name), Err: err}
}

func openat2Retry(root int, name string) (int, error) {
	how := unix.OpenHow{Flags: readFlags, Resolve: resolveFlags}
	for range resolveAttempts {
		fd, err := openat2(root, name, &how)
		if !errors.Is(err, unix.EAGAIN) {
			return fd, err
		}
	}
	return -1, unix.EAGAIN
}

// walkOpen opens name's folder without following a link, then name in it
// with O_NOFOLLOW.
func (b *Backend) walkOpen(name string) (int, error) {
	dir, base := splitName(name)
	dfd, err := b.openDir(dir, pathFlags)
	if err != nil {
		return -1, err
	}
	defer closeFD(dfd)
	fd, err := unix.Openat(dfd, base, readFlags, 0)
	if err != nil {
		return -1, objectErr("open", b.abs(name), name, err)
	}
	return fd, nil
}

// kind names st's file type, for messages.
func kind(st *unix.Stat_t) string {
	switch fileType(st) {
	case unix.S_IFDIR:
		return "a folder"
	case unix.S_IFIFO:
		return "a named pipe"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFSOCK:
		return "a socket"
	}
	return fmt.Sprintf("file type %#o", fileType(st))
}
