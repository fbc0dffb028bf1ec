package posix

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

const (
	tempMarker = ".tmp-"
	tempDigits = 16 // hex digits
	// tempExtra is what tempName adds to the base name.
	tempExtra = 1 + len(tempMarker) + tempDigits
	// createAttempts bounds the retries of createTemp. A retry happens only
	// when a concurrent Delete removed a folder just created or opened, or
	// on a 64-bit random collision, so a handful is plenty.
	createAttempts = 8
)

// tempName returns a fresh temporary file name for an object whose last
// segment is base; see the package documentation for the form.
func tempName(base string) string {
	return fmt.Sprintf(".%s%s%016x", cutBase(base), tempMarker, tempRandom())
}

// cutBase is the part of an object's last segment that its temporary
// files' names keep: all of it, unless the whole would pass 255 bytes.
func cutBase(base string) string {
	if max := 255 - tempExtra; len(base) > max {
		return base[:max]
	}
	return base
}

// tempBase is the object's last segment (cut as cutBase cuts it) in a
// name of tempName's form.
func tempBase(name string) string { return name[1 : len(name)-len(tempMarker)-tempDigits] }

// tempRandom is rand.Uint64; tests replace it to know the next temporary
// name in advance.
var tempRandom = rand.Uint64

// isTempName reports whether a file name has tempName's form.
func isTempName(name string) bool {
	if len(name) < 1+tempExtra || name[0] != '.' {
		return false
	}
	tail := name[len(name)-len(tempMarker)-tempDigits:]
	if !strings.HasPrefix(tail, tempMarker) {
		return false
	}
	for _, c := range tail[len(tempMarker):] {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func lastSegment(name string) string {
	return name[strings.LastIndexByte(name, '/')+1:]
}

// tempFile is a temporary file being written next to its destination,
// with what is needed to publish it durably or to undo it. It owns the
// descriptors it holds; release closes them.
type tempFile struct {
	f    *os.File // nil once closed
	dir  int      // the destination folder, opened with dirFlags; -1 once released
	name string   // the temporary file's name in dir; "" once renamed or removed
	base string   // the destination's name in dir
	// made are the folders created for this file, top-down, each with its
	// parent held open: their entries in their parents are not known to be
	// durable yet. Concurrent writers may have made the same folder at the
	// same moment; each then syncs it.
	made []madeDir
}

type madeDir struct {
	parent int
	name   string
}

// createTemp creates the temporary file for the object name, creating
// missing folders. With absent, an existing object fails with
// storage.ErrExists before anything is written. A link where the object
// would go fails with a *linkError: Put would replace only the link, but a
// link in the store is a sign of tampering, so it is reported, not fixed.
func (b *Backend) createTemp(name string, absent bool) (*tempFile, error) {
	dir, base := splitName(name)
	var err error
	for range createAttempts {
		t := &tempFile{dir: -1, base: base}
		if err = t.prepare(b, dir, name, absent); err == nil {
			return t, nil
		}
		t.abort()
		// ENOENT: a concurrent Delete removed a folder just made or opened;
		// EEXIST: a 64-bit random collision (or something planted at the
		// temporary name). Both deserve another go.
		if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
	}
	return nil, err
}

func (t *tempFile) prepare(b *Backend, dir, name string, absent bool) error {
	fd, err := b.openDir(dir, dirFlags)
	if errors.Is(err, fs.ErrNotExist) {
		err = t.makeDirs(b, dir)
	} else {
		t.dir = fd
	}
	if err != nil {
		return err
	}
	st, err := statAt(t.dir, t.base)
	switch {
	case err == nil && fileType(&st) == unix.S_IFLNK:
		return &linkError{link: name}
	case err == nil && absent:
		return storage.ErrExists
	case err != nil && !errors.Is(err, unix.ENOENT):
		return &fs.PathError{Op: "stat", Path: b.abs(name), Err: err}
	}
	return t.create(b, dir)
}

// makeDirs opens the folder rel, creating those missing on the way one at
// a time from the root, never through a link.
func (t *tempFile) makeDirs(b *Backend, rel string) error {
	fd, err := b.openDir("", dirFlags)
	if err != nil {
		return err
	}
	done := 0
	for seg := range strings.SplitSeq(rel, "/") {
		path := rel[:done+len(seg)]
		next, made, err := makeChild(fd, seg, b.dirMode)
		if made {
			t.made = append(t.made, madeDir{parent: fd, name: seg})
		} else {
			closeFD(fd)
		}
		if err != nil {
			if err = asLinkError(err, path); !errors.Is(err, storage.ErrSymlink) {
				err = &fs.PathError{Op: "mkdir", Path: b.abs(path), Err: err}
			}
			return err
		}
		fd, done = next, done+len(seg)+1
	}
	t.dir = fd
	return nil
}

// makeChild opens the folder name in dir, creating it with mode if it is
// missing, and reports whether it made it. mkdir's mode is cut by the
// umask, so a folder it made gets its mode again with fchmod.
func makeChild(dir int, name string, mode uint32) (fd int, made bool, err error) {
	fd, err = openChild(dir, name, dirFlags)
	if !errors.Is(err, unix.ENOENT) {
		return fd, false, err
	}
	err = unix.Mkdirat(dir, name, mode)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, false, err
	}
	made = err == nil
	if fd, err = openChild(dir, name, dirFlags); err == nil && made {
		if err = setMode(fd, mode); err != nil {
			closeFD(fd)
			fd = -1
		}
	}
	return fd, made, err
}

// create makes the temporary file in t.dir with exactly the backend's
// file mode, whatever the umask.
func (t *tempFile) create(b *Backend, dir string) error {
	name := tempName(t.base)
	path := b.abs(dir + "/" + name)
	fd, err := unix.Openat(t.dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, b.fileMode)
	if err != nil {
		return &fs.PathError{Op: "create", Path: path, Err: err}
	}
	t.f, t.name = os.NewFile(uintptr(fd), path), name
	return setMode(fd, b.fileMode)
}

// setMode sets a file's mode with fchmod. File systems that fix modes
// themselves (some FUSE and SMB mounts) refuse it; their modes are theirs.
func setMode(fd int, mode uint32) error {
	err := unix.Fchmod(fd, mode)
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	if err != nil {
		return os.NewSyscallError("fchmod", err)
	}
	return nil
}

// closeSynced flushes the file to stable storage and closes it.
func (t *tempFile) closeSynced() error {
	err := t.f.Sync()
	if cerr := t.f.Close(); err == nil {
		err = cerr
	}
	t.f = nil
	return err
}

// rename publishes the file under its destination name, replacing what is
// there.
func (t *tempFile) rename() error {
	if err := unix.Renameat(t.dir, t.name, t.dir, t.base); err != nil {
		return os.NewSyscallError("rename", err)
	}
	t.name = ""
	return nil
}

// syncDirs makes the directory entries of the published file, and of the
// folders created for it, durable. A folder that another writer had created
// just before this Put looked is left to that writer, which syncs it before
// its own Put returns; only a crash between the two returns can lose this
// Put's object that way.
func (t *tempFile) syncDirs() error {
	if err := syncDir(t.dir); err != nil {
		return err
	}
	for _, m := range t.made {
		if err := syncDir(m.parent); err != nil {
			return err
		}
	}
	return nil
}

func syncDir(fd int) error {
	err := unix.Fsync(fd)
	// Some file systems cannot fsync a directory; there is nothing better to
	// do there, and their renames are usually synchronous anyway.
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	return os.NewSyscallError("fsync", err)
}

// abort undoes an unpublished temporary file: it removes it and the folders
// made for it if they are empty again, then releases the descriptors.
// Errors are ignored; the caller is already returning one.
func (t *tempFile) abort() {
	if t.f != nil {
		_ = t.f.Close()
		t.f = nil
	}
	if t.name != "" && t.dir >= 0 {
		_ = unix.Unlinkat(t.dir, t.name, 0)
		t.name = ""
	}
	for i := len(t.made) - 1; i >= 0; i-- {
		_ = unix.Unlinkat(t.made[i].parent, t.made[i].name, unix.AT_REMOVEDIR)
	}
	t.release()
}

// finish releases t after a Put that returned *errp: it aborts it first if
// that is an error.
func (t *tempFile) finish(errp *error) {
	if *errp != nil {
		t.abort()
	}
	t.release()
}

// release closes the descriptors t holds.
func (t *tempFile) release() {
	if t.f != nil {
		_ = t.f.Close()
		t.f = nil
	}
	closeFD(t.dir)
	t.dir = -1
	for _, m := range t.made {
		closeFD(m.parent)
	}
	t.made = nil
}
