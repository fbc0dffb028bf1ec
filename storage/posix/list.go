package posix

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// List implements storage.Backend. It walks only the directory named by the
// part of prefix up to its last slash, reading one directory at a time, so
// its memory is bounded by the largest directory, not the store.
func (b *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("posix: list: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("posix: list %q: %w", prefix, err)
	}
	dir := prefix[:strings.LastIndexByte(prefix, '/')+1] // "" or ends in "/"
	l := &lister{root: b.root, prefix: prefix, fn: fn}
	err := l.walk(ctx, dir)
	var fe fnError
	if errors.As(err, &fe) {
		return fe.err // the caller's own error, as it gave it
	}
	if err != nil {
		return fmt.Errorf("posix: list %q: %w", prefix, err)
	}
	return nil
}

// fnError carries an error from List's callback out of the walk.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

type lister struct {
	root   string
	prefix string
	fn     func(storage.ObjectInfo) error
}

// entry is a directory entry with the key it sorts by.
type entry struct {
	key string // object name, or directory name plus "/"
	de  fs.DirEntry
}

// walk lists the objects under dir ("" or a name ending in "/") in lexical
// order of their full names. Sorting a directory's entries with a "/"
// appended to subdirectory names makes a depth-first walk produce that
// order: "a/x" must come after "a.b" and before "a0", and so must "a/".
func (l *lister) walk(ctx context.Context, dir string) error {
	entries, err := readDir(filepath.Join(l.root, filepath.FromSlash(dir)))
	if err != nil {
		return err
	}
	sorted := make([]entry, 0, len(entries))
	for _, de := range entries {
		if isTempName(de.Name()) {
			continue
		}
		key := dir + de.Name()
		if de.IsDir() {
			key += "/"
		}
		sorted = append(sorted, entry{key: key, de: de})
	}
	slices.SortFunc(sorted, func(a, b entry) int { return strings.Compare(a.key, b.key) })
	for _, e := range sorted {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := l.visit(ctx, e); err != nil {
			return err
		}
	}
	return nil
}

func (l *lister) visit(ctx context.Context, e entry) error {
	if e.de.IsDir() {
		// Descend only where names can still match the prefix.
		if strings.HasPrefix(e.key, l.prefix) || strings.HasPrefix(l.prefix, e.key) {
			return l.walk(ctx, e.key)
		}
		return nil
	}
	if !strings.HasPrefix(e.key, l.prefix) {
		return nil
	}
	info, err := l.stat(e)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // deleted since the directory was read
	}
	if err != nil {
		return err
	}
	if !info.Mode().IsRegular() {
		return nil
	}
	if err := l.fn(storage.ObjectInfo{Name: e.key, Size: info.Size(), ModTime: info.ModTime()}); err != nil {
		return fnError{err}
	}
	return nil
}

// stat returns the entry's file info, following a symbolic link so that a
// link to a regular file lists as an object, as Stat and Get see it.
func (l *lister) stat(e entry) (fs.FileInfo, error) {
	if e.de.Type()&fs.ModeSymlink != 0 {
		return os.Stat(filepath.Join(l.root, filepath.FromSlash(e.key)))
	}
	return e.de.Info()
}

// readDir reads a directory; a missing one (or a file where a directory
// would be) holds no objects.
func readDir(path string) ([]fs.DirEntry, error) {
	entries, err := os.ReadDir(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		return nil, nil
	}
	return entries, err
}

// ListDirs implements storage.Backend with one read of dir. A subdirectory
// counts only if it holds an object somewhere below it (a walk that stops
// at the first), so neither an empty directory nor one holding only a
// Put's temporary file is listed.
func (b *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	if err := storage.ValidDir(dir); err != nil {
		return fmt.Errorf("posix: list dirs: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("posix: list dirs %q: %w", dir, err)
	}
	entries, err := readDir(filepath.Join(b.root, filepath.FromSlash(dir)))
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
		found, err := b.holdsObject(ctx, dir+seg)
		if err != nil {
			return fmt.Errorf("posix: list dirs %q: %w", dir, err)
		}
		if !found {
			continue
		}
		if err := fn(strings.TrimSuffix(seg, "/")); err != nil {
			return err
		}
	}
	return nil
}

// holdsObject reports whether any object lies below dir. It reads the
// directory in batches and stops at the first object, so a step folder of
// thousands of ranks costs one small read, not a listing; subdirectories
// are searched only when dir itself holds no object.
func (b *Backend) holdsObject(ctx context.Context, dir string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	f, err := os.Open(filepath.Join(b.root, filepath.FromSlash(dir)))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOTDIR) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	var subdirs []string
	for {
		entries, err := f.ReadDir(256)
		for _, de := range entries {
			switch {
			case isTempName(de.Name()):
			case de.IsDir():
				subdirs = append(subdirs, de.Name())
			case b.isObject(dir, de):
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
		if found, err := b.holdsObject(ctx, dir+sub+"/"); found || err != nil {
			return found, err
		}
	}
	return false, nil
}

// isObject reports whether a directory entry is one List would list: a
// regular file, or a link to one.
func (b *Backend) isObject(dir string, de fs.DirEntry) bool {
	if de.Type().IsRegular() {
		return true
	}
	if de.Type()&fs.ModeSymlink == 0 {
		return false
	}
	fi, err := os.Stat(filepath.Join(b.root, filepath.FromSlash(dir+de.Name())))
	return err == nil && fi.Mode().IsRegular()
}
