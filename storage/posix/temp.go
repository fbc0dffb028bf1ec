package posix

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

const (
	tempMarker = ".tmp-"
	tempRandom = 16 // hex digits
	// tempExtra is what tempName adds to the base name.
	tempExtra = 1 + len(tempMarker) + tempRandom
	// createAttempts bounds the retries of createTemp. A retry happens only
	// when a concurrent Delete removed the directory just created, or on a
	// 64-bit random collision, so a handful is plenty.
	createAttempts = 8
)

// tempName returns a fresh temporary file name for an object whose last
// segment is base; see the package documentation for the form.
func tempName(base string) string {
	if max := 255 - tempExtra; len(base) > max {
		base = base[:max]
	}
	return fmt.Sprintf(".%s%s%016x", base, tempMarker, rand.Uint64())
}

// isTempName reports whether a file name has tempName's form.
func isTempName(name string) bool {
	if len(name) < 1+tempExtra || name[0] != '.' {
		return false
	}
	tail := name[len(name)-len(tempMarker)-tempRandom:]
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
// with what is needed to publish it durably or to undo it.
type tempFile struct {
	f    *os.File // nil once closed
	path string   // "" once renamed or removed
	dir  string   // the destination directory
	// created are the directories made for this file, top-down, including
	// ones a concurrent writer made at the same moment: their entries in
	// their parents are not known to be durable yet.
	created []string
}

// createTemp creates the temporary file for the destination p, creating
// missing parent directories.
func (b *Backend) createTemp(p string) (*tempFile, error) {
	dir, base := filepath.Split(p)
	dir = filepath.Clean(dir)
	t := &tempFile{dir: dir}
	for attempt := 1; ; attempt++ {
		name := filepath.Join(dir, tempName(base))
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o666)
		if err == nil {
			t.f, t.path = f, name
			return t, nil
		}
		retry := errors.Is(err, fs.ErrExist)
		if errors.Is(err, fs.ErrNotExist) {
			// The directory is missing, or a concurrent Delete removed it
			// after we made it.
			created, mkErr := b.mkdirs(dir)
			t.created = append(t.created, created...)
			if mkErr != nil && !errors.Is(mkErr, fs.ErrNotExist) {
				t.abort()
				return nil, mkErr
			}
			// On ErrNotExist a concurrent Delete removed an ancestor
			// between our stat and mkdir: start over.
			err, retry = cmp.Or(mkErr, err), true
		}
		if !retry || attempt == createAttempts {
			t.abort()
			return nil, err
		}
	}
}

// mkdirs creates dir and its missing ancestors below the root, and returns
// them top-down.
func (b *Backend) mkdirs(dir string) ([]string, error) {
	var missing []string
	for d := dir; len(d) > len(b.root); d = filepath.Dir(d) {
		_, err := os.Stat(d)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		missing = append(missing, d)
	}
	created := make([]string, 0, len(missing))
	for i := len(missing) - 1; i >= 0; i-- {
		if err := os.Mkdir(missing[i], 0o777); err != nil && !errors.Is(err, fs.ErrExist) {
			return created, err
		}
		created = append(created, missing[i])
	}
	return created, nil
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

// syncDirs makes the directory entries of the published file, and of the
// directories created for it, durable. A directory that another writer had
// created just before this Put looked is left to that writer, which syncs it
// before its own Put returns; only a crash between the two returns can lose
// this Put's object that way.
func (t *tempFile) syncDirs() error {
	dirs := []string{t.dir}
	seen := map[string]bool{t.dir: true}
	for _, d := range t.created {
		if parent := filepath.Dir(d); !seen[parent] {
			seen[parent] = true
			dirs = append(dirs, parent)
		}
	}
	for _, d := range dirs {
		if err := syncDir(d); err != nil {
			return err
		}
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	// Some file systems cannot fsync a directory; there is nothing better to
	// do there, and their renames are usually synchronous anyway.
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	return err
}

// abort undoes an unpublished temporary file: it closes and removes it and
// removes the directories made for it if they are empty again. Errors are
// ignored; the caller is already returning one.
func (t *tempFile) abort() {
	if t.f != nil {
		_ = t.f.Close()
		t.f = nil
	}
	if t.path != "" {
		_ = os.Remove(t.path)
		t.path = ""
	}
	for i := len(t.created) - 1; i >= 0; i-- {
		_ = unix.Rmdir(t.created[i])
	}
	t.created = nil
}
