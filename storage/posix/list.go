package posix

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// List implements storage.Backend. It walks only the folder named by the
// part of prefix up to its last slash, reading one folder at a time, so
// its memory is bounded by the largest folder, not the store. Links are
// skipped, never followed: neither a link to a file nor one to a folder is
// listed. If a folder on the way to the prefix's own folder is a link,
// List fails with storage.ErrSymlink.
func (b *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("posix: list: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("posix: list %q: %w", prefix, err)
	}
	return b.walk(ctx, "list", &lister{prefix: prefix, fn: fn})
}

// walk runs l from the folder of its prefix's last slash.
func (b *Backend) walk(ctx context.Context, op string, l *lister) error {
	dir := l.prefix[:strings.LastIndexByte(l.prefix, '/')+1] // "" or ends in "/"
	d, err := b.openListed(strings.TrimSuffix(dir, "/"))
	if err == nil && d != nil {
		err = l.walk(ctx, d, dir)
		d.close()
	}
	var fe fnError
	if errors.As(err, &fe) {
		return fe.err // the caller's own error, as it gave it
	}
	if err != nil {
		return fmt.Errorf("posix: %s %q: %w", op, l.prefix, err)
	}
	return nil
}

// ListTemporaries implements storage.Backend: the temporary files of Puts
// in progress and of writers that died, walked as List walks objects (the
// prefix applies to the object each would become). A Put's own file shows
// here from its creation until its rename.
func (b *Backend) ListTemporaries(ctx context.Context, prefix string, fn func(storage.Temporary) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("posix: list temporaries: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("posix: list temporaries %q: %w", prefix, err)
	}
	return b.walk(ctx, "list temporaries", &lister{prefix: prefix, temps: fn})
}

// DeleteTemporary implements storage.Backend: it unlinks the temporary
// file t.ID in t.Name's folder, which must have tempName's form for that
// object, then removes the folders that became empty, as Delete does. A
// Put writing to it fails at its rename. A link of that name is refused.
func (b *Backend) DeleteTemporary(ctx context.Context, t storage.Temporary) error {
	if err := storage.ValidName(t.Name); err != nil {
		return fmt.Errorf("posix: delete temporary: %w", err)
	}
	dir, base := splitName(t.Name)
	if !isTempName(t.ID) || strings.Contains(t.ID, "/") || tempBase(t.ID) != cutBase(base) {
		return fmt.Errorf("posix: delete temporary %q of %q: %w: not a temporary file of that object", t.ID, t.Name, storage.ErrInvalidName)
	}
	if err := ctx.Err(); err != nil {
		return wrapErr("delete temporary", t.Name, err)
	}
	name := t.Name[:len(t.Name)-len(base)] + t.ID
	dfd, err := b.openDir(dir, pathFlags)
	if err == nil {
		defer closeFD(dfd)
		err = b.unlinkObject(dfd, name, t.ID)
	}
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.EISDIR) {
		return nil // gone: renamed, aborted, removed
	}
	if err != nil {
		return wrapErr("delete temporary", name, err)
	}
	b.removeEmptyDirs(dir)
	return nil
}

// fnError carries an error from List's callback out of the walk.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

// folder is a folder open for reading, with the descriptor that names
// entries relative to it.
type folder struct {
	f  *os.File
	fd int // f's descriptor, valid until close
}

func newFolder(fd int, path string) *folder {
	return &folder{f: os.NewFile(uintptr(fd), path), fd: fd}
}

func (d *folder) close() { _ = d.f.Close() }

// openListed opens the folder rel for reading; a missing one (or a file
// where a folder would be) holds no objects and gives nil.
func (b *Backend) openListed(rel string) (*folder, error) {
	fd, err := b.openDir(rel, dirFlags)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return newFolder(fd, b.abs(rel)), nil
}

// sub opens the subfolder name of d, not through a link; it gives nil if
// the entry is gone or is no longer a folder (or has become a link).
func (d *folder) sub(name string) (*folder, error) {
	fd, err := openChild(d.fd, name, dirFlags)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
		return nil, nil
	}
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: d.f.Name() + "/" + name, Err: err}
	}
	return newFolder(fd, d.f.Name()+"/"+name), nil
}

// lister walks folders for List (fn) or, when temps is set, for
// ListTemporaries: then only temporary files are visited, keyed by the
// object they would become.
type lister struct {
	prefix string
	fn     func(storage.ObjectInfo) error
	temps  func(storage.Temporary) error
}

// entry is a directory entry with the key it sorts by.
type entry struct {
	key string // object name, or folder name plus "/"
	de  fs.DirEntry
}

// walk lists the objects in d, the folder dir ("" or a name ending in
// "/"), in lexical order of their full names. Sorting a folder's entries
// with a "/" appended to subfolder names makes a depth-first walk produce
// that order: "a/x" must come after "a.b" and before "a0", and so must
// "a/".
func (l *lister) walk(ctx context.Context, d *folder, dir string) error {
	entries, err := d.f.ReadDir(-1)
	if err != nil {
		return err
	}
	sorted := make([]entry, 0, len(entries))
	for _, de := range entries {
		temp := isTempName(de.Name())
		if de.Type()&fs.ModeSymlink != 0 || temp && de.IsDir() || !de.IsDir() && temp != (l.temps != nil) {
			continue // links; folders of a temporary's form; objects or temporaries, whichever is not listed
		}
		key := dir + de.Name()
		switch {
		case de.IsDir():
			key += "/"
		case temp:
			key = dir + tempBase(de.Name())
		}
		sorted = append(sorted, entry{key: key, de: de})
	}
	slices.SortFunc(sorted, func(a, b entry) int { return strings.Compare(a.key, b.key) })
	for _, e := range sorted {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := l.visit(ctx, d, e); err != nil {
			return err
		}
	}
	return nil
}

func (l *lister) visit(ctx context.Context, d *folder, e entry) error {
	if e.de.IsDir() {
		// Descend only where names can still match the prefix.
		if !strings.HasPrefix(e.key, l.prefix) && !strings.HasPrefix(l.prefix, e.key) {
			return nil
		}
		sub, err := d.sub(e.de.Name())
		if sub == nil {
			return err
		}
		defer sub.close()
		return l.walk(ctx, sub, e.key)
	}
	if !strings.HasPrefix(e.key, l.prefix) || !e.de.Type().IsRegular() {
		return nil
	}
	st, err := statAt(d.fd, e.de.Name())
	if errors.Is(err, unix.ENOENT) {
		return nil // deleted since the folder was read
	}
	if err != nil {
		return &fs.PathError{Op: "stat", Path: d.f.Name() + "/" + e.de.Name(), Err: err}
	}
	if fileType(&st) != unix.S_IFREG {
		return nil // replaced since
	}
	if l.temps != nil {
		err = l.temps(storage.Temporary{Name: e.key, ID: e.de.Name(), Size: st.Size, ModTime: time.Unix(st.Mtim.Unix())})
	} else {
		err = l.fn(objectInfo(e.key, &st))
	}
	if err != nil {
		return fnError{err}
	}
	return nil
}

// ListDirs implements storage.Backend with one read of dir. A subfolder
// counts only if it holds an object somewhere below it (a walk that stops
// at the first), so neither an empty folder nor one holding only a Put's
// temporary file is listed; links are not folders here and are never
// followed.
func (b *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	if err := storage.ValidDir(dir); err != nil {
		return fmt.Errorf("posix: list dirs: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("posix: list dirs %q: %w", dir, err)
	}
	d, err := b.openListed(strings.TrimSuffix(dir, "/"))
	if d == nil {
		if err != nil {
			return fmt.Errorf("posix: list dirs %q: %w", dir, err)
		}
		return nil
	}
	defer d.close()
	entries, err := d.f.ReadDir(-1)
	if err != nil {
		return fmt.Errorf("posix: list dirs %q: %w", dir, err)
	}
	var segs []string
	for _, de := range entries {
		if de.IsDir() && !isTempName(de.Name()) {
			segs = append(segs, de.Name()+"/")
		}
	}
	slices.Sort(segs) // by seg+"/", the order S3 gives common prefixes
	for _, seg := range segs {
		seg = strings.TrimSuffix(seg, "/")
		found, err := holdsObject(ctx, d, seg)
		if err != nil {
			return fmt.Errorf("posix: list dirs %q: %w", dir, err)
		}
		if !found {
			continue
		}
		if err := fn(seg); err != nil {
			return err
		}
	}
	return nil
}

// holdsObject reports whether any object lies below the subfolder name of
// parent. It reads the folder in batches and stops at the first object, so
// a step folder of thousands of ranks costs one small read, not a listing;
// subfolders are searched only when the folder itself holds no object.
func holdsObject(ctx context.Context, parent *folder, name string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	d, err := parent.sub(name)
	if d == nil {
		return false, err
	}
	defer d.close()
	var subdirs []string
	for {
		entries, err := d.f.ReadDir(256)
		for _, de := range entries {
			switch {
			case isTempName(de.Name()):
			case de.IsDir():
				subdirs = append(subdirs, de.Name())
			case de.Type().IsRegular():
				return true, nil
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return false, err
		}
	}
	for _, sub := range subdirs {
		if found, err := holdsObject(ctx, d, sub); found || err != nil {
			return found, err
		}
	}
	return false, nil
}
