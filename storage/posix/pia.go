package posix

import (
	"bytes"
	"context"
	"errors"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// linkat is unix.Linkat; tests replace it to simulate a file system
// without hard links.
var linkat = unix.Linkat

// PutIfAbsent implements storage.Backend.
//
// On file systems without hard links (link(2) fails with EPERM or
// EOPNOTSUPP) it falls back to creating the name with O_EXCL and writing into
// it. That is still exclusive, but not atomic for contents: a reader can see
// a partly written object, and a crash can leave one behind.
func (b *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	if err := b.check(name); err != nil {
		return err
	}
	if err := b.putIfAbsent(ctx, name, data); err != nil {
		return wrapErr("put-if-absent", name, err)
	}
	return nil
}

func (b *Backend) putIfAbsent(ctx context.Context, name string, data []byte) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	t, err := b.createTemp(name, true)
	if err != nil {
		return err
	}
	defer t.finish(&err)
	if err := b.writeFile(ctx, t.f, bytes.NewReader(data), int64(len(data))); err != nil {
		return err
	}
	if err := t.closeSynced(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	err = linkat(t.dir, t.name, t.dir, t.base, 0)
	if linkUnsupported(err) {
		err = createExclusive(t.dir, t.base, b.fileMode, data)
	}
	if errors.Is(err, unix.EEXIST) {
		if isLink(t.dir, t.base) {
			return &linkError{link: name}
		}
		return storage.ErrExists
	}
	if err != nil {
		return err
	}
	// Remove the temporary name before syncing, so one folder fsync makes
	// both the new link and the removal durable.
	_ = unix.Unlinkat(t.dir, t.name, 0)
	t.name = ""
	return t.syncDirs()
}

// linkUnsupported: link(2) on a file system without hard links.
func linkUnsupported(err error) bool {
	return errors.Is(err, unix.EPERM) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS)
}

// createExclusive is PutIfAbsent's fallback for file systems without hard
// links; see PutIfAbsent.
func createExclusive(dir int, name string, mode uint32, data []byte) error {
	fd, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), name)
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = unix.Unlinkat(dir, name, 0)
	}
	return err
}
