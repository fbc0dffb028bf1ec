package posix

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// Every path the backend touches is resolved from an open descriptor of the
// root and never through a symbolic link: with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS) in one system call where the kernel has it (Linux
// 5.6), else one openat(O_NOFOLLOW) per folder. The final name is then
// handled with the *at calls relative to its folder's descriptor, with
// O_NOFOLLOW or AT_SYMLINK_NOFOLLOW. A path string is never handed to the
// kernel whole, so a link planted anywhere below the root cannot redirect a
// write, a rename or an unlink outside it.

const (
	// dirFlags open a folder whose descriptor is used to read it or fsync it.
	dirFlags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC
	// pathFlags open a folder only to name things relative to it: it needs
	// no read permission and, on network file systems, no open RPC.
	pathFlags = unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC
	// resolveFlags refuse every link and any escape from the root.
	resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS
	// resolveAttempts bounds retries of openat2's EAGAIN, which it returns
	// when a concurrent rename somewhere on the system might have raced
	// with the lookup.
	resolveAttempts = 8
)

// openat2 is unix.Openat2; tests replace it to simulate a kernel without it.
var openat2 = unix.Openat2

// linkError reports a symbolic link found below the root.
type linkError struct {
	link string // its path relative to the root
}

func (e *linkError) Error() string {
	return fmt.Sprintf("%v: %q is a symbolic link, and links below the store's root are not followed", storage.ErrSymlink, e.link)
}

func (e *linkError) Unwrap() error { return storage.ErrSymlink }

// openRoot opens the root folder once; a link in the root's own path is the
// operator's choice and is followed here, and only here.
func openRoot(root string) (*os.File, bool, error) {
	fd, err := unix.Open(root, pathFlags, 0)
	if err != nil {
		return nil, false, &fs.PathError{Op: "open", Path: root, Err: err}
	}
	probe, err := openat2(fd, ".", &unix.OpenHow{Flags: pathFlags, Resolve: resolveFlags})
	if err == nil {
		_ = unix.Close(probe)
	}
	// ENOSYS: before Linux 5.6; EPERM: a seccomp filter that predates it.
	return os.NewFile(uintptr(fd), root), err == nil, nil
}

// withRoot runs fn with the root's descriptor, which stays valid until fn
// returns even if Close runs meanwhile; after Close it fails.
func (b *Backend) withRoot(fn func(root int) error) error {
	rc, err := b.rootDir.SyscallConn()
	if err != nil {
		return err
	}
	var fnErr error
	if err := rc.Control(func(fd uintptr) { fnErr = fn(int(fd)) }); err != nil {
		return fmt.Errorf("store %s: %w", b.root, err)
	}
	return fnErr
}

// openDir opens the folder rel ("" for the root itself, else a valid name)
// with flags (dirFlags or pathFlags). A link on the way fails with a
// *linkError; a missing folder, or a file where a folder should be, with
// ENOENT or ENOTDIR in a *fs.PathError.
func (b *Backend) openDir(rel string, flags int) (int, error) {
	fd := -1
	err := b.withRoot(func(root int) error {
		var err error
		if b.openat2 {
			fd, err = resolveBeneath(root, rel, flags)
			if !errors.Is(err, unix.ELOOP) {
				return err
			}
			// Some folder on the way is a link: find which, for the message.
		}
		fd, err = walkDir(root, rel, flags)
		if errors.Is(err, unix.ELOOP) {
			err = &linkError{link: rel}
		}
		return err
	})
	var le *linkError
	if err != nil && !errors.As(err, &le) {
		err = &fs.PathError{Op: "open", Path: b.abs(rel), Err: err}
	}
	return fd, err
}

func resolveBeneath(root int, rel string, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags), Resolve: resolveFlags}
	for range resolveAttempts {
		fd, err := openat2(root, cmp.Or(rel, "."), &how)
		if !errors.Is(err, unix.EAGAIN) {
			return fd, err
		}
	}
	// Renames keep racing with the lookup: take the slow, equally safe way.
	return walkDir(root, rel, flags)
}

// walkDir opens rel one folder at a time from root, refusing links.
func walkDir(root int, rel string, flags int) (int, error) {
	fd, err := unix.Openat(root, ".", flags, 0)
	if err != nil || rel == "" {
		return fd, err
	}
	done := 0
	for seg := range strings.SplitSeq(rel, "/") {
		next, err := openChild(fd, seg, flags)
		if err != nil {
			_ = unix.Close(fd)
			return -1, asLinkError(err, rel[:done+len(seg)])
		}
		_ = unix.Close(fd)
		fd, done = next, done+len(seg)+1
	}
	return fd, nil
}

// openChild opens the folder name in dir without following a link. A link
// with O_DIRECTORY|O_NOFOLLOW fails with ENOTDIR, like a file would, so
// ENOTDIR is looked at again.
func openChild(dir int, name string, flags int) (int, error) {
	fd, err := unix.Openat(dir, name, flags|unix.O_NOFOLLOW, 0)
	if errors.Is(err, unix.ENOTDIR) && isLink(dir, name) {
		return -1, unix.ELOOP
	}
	return fd, err
}

// asLinkError turns ELOOP (a link at path) into a *linkError.
func asLinkError(err error, path string) error {
	if errors.Is(err, unix.ELOOP) {
		return &linkError{link: path}
	}
	return err
}

// isLink reports whether dir holds a symbolic link called name.
func isLink(dir int, name string) bool {
	var st unix.Stat_t
	err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	return err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK
}

// statAt returns the metadata of name in dir, not following a link.
func statAt(dir int, name string) (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	return st, err
}

func fileType(st *unix.Stat_t) uint32 { return st.Mode & unix.S_IFMT }

// abs is rel's path for messages.
func (b *Backend) abs(rel string) string {
	return filepath.Join(b.root, filepath.FromSlash(rel))
}

// splitName returns the folder of a name ("" at the top) and its last
// segment.
func splitName(name string) (dir, base string) {
	i := strings.LastIndexByte(name, '/')
	if i < 0 {
		return "", name
	}
	return name[:i], name[i+1:]
}

func closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd)
	}
}
