package posix

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// ErrNotRegular: an open found something other than a regular file
// (a folder, a FIFO, a device, a socket) where a file was expected.
var ErrNotRegular = errors.New("not a regular file")

// LinkError: OpenBeneath met a symbolic link at Link (relative to the
// root). It matches storage.ErrSymlink.
type LinkError struct{ Link string }

func (e *LinkError) Error() string {
	return fmt.Sprintf("%q is a symbolic link, and links are not followed", e.Link)
}

func (e *LinkError) Unwrap() error { return storage.ErrSymlink }

// OpenBeneath opens the regular file name (a valid name) for reading,
// resolved as every path of the backend is (see openObject): beneath the
// root, through no symbolic link. It is for files the backend did not
// write (a dataset's shards), which may have been swapped since they were
// listed. A link anywhere on the way fails with a *LinkError naming it; a
// file of another type with ErrNotRegular, closed again before anything
// is read from it; a missing file or folder with fs.ErrNotExist.
func (b *Backend) OpenBeneath(name string) (*os.File, error) {
	if err := storage.ValidName(name); err != nil {
		return nil, fmt.Errorf("posix: %w", err)
	}
	f, _, err := b.openObject(name)
	if le, ok := errors.AsType[*linkError](err); ok {
		return nil, &LinkError{Link: le.link}
	}
	return f, err
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
