package posix

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/storage"
)

// ErrNoAtomicCreate: the file system offers neither of the calls that
// PutIfAbsent needs to publish a whole file only if its name is free.
var ErrNoAtomicCreate = errors.New("file system cannot create a file atomically only if it is absent")

// The system calls that publish PutIfAbsent's file; tests replace them to
// simulate file systems without them.
var (
	linkat    = unix.Linkat
	renameat2 = unix.Renameat2
)

// crashPoint, when set by a test, is called at the named steps of
// PutIfAbsent ("synced": the temporary file is durable, nothing is
// published; "published": the name is taken, the folder not yet synced),
// so that a test can kill the process there.
var crashPoint func(step string)

// PutIfAbsent implements storage.Backend. The data goes to a temporary file
// that is fsynced before anything is published, then takes the name with
// the first of these the file system supports, each of which fails with
// EEXIST if the name is taken, atomically across processes and across nodes
// sharing the file system, and never shows a part of the file:
//
//  1. link(2) of the temporary file to the name (every POSIX file system
//     that ckptd targets: ext4, xfs, btrfs, tmpfs, NFS, Lustre, GPFS);
//  2. renameat2(2) with RENAME_NOREPLACE, for file systems without hard
//     links that have it (vfat, exfat, FUSE file systems that implement
//     it).
//
// On a file system with neither it fails with ErrNoAtomicCreate, naming
// the file system: creating the name with O_EXCL and writing into it, the
// only other way to be exclusive, lets readers see a partial object and
// leaves a torn one after a crash, which for a commit record would block
// the step for good.
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
	reach("synced")
	err = t.publishExclusive()
	if errors.Is(err, unix.EEXIST) {
		if isLink(t.dir, t.base) {
			return &linkError{link: name}
		}
		return storage.ErrExists
	}
	if err != nil {
		return err
	}
	reach("published")
	return t.syncDirs()
}

func reach(step string) {
	if crashPoint != nil {
		crashPoint(step)
	}
}

// publishExclusive gives the temporary file its destination name unless
// the name is taken; see PutIfAbsent.
func (t *tempFile) publishExclusive() error {
	err := linkat(t.dir, t.name, t.dir, t.base, 0)
	if err == nil {
		// Remove the temporary name before syncing, so one folder fsync
		// makes both the new link and the removal durable.
		_ = unix.Unlinkat(t.dir, t.name, 0)
		t.name = ""
		return nil
	}
	if !linkUnsupported(err) {
		return os.NewSyscallError("link", err)
	}
	err = renameat2(t.dir, t.name, t.dir, t.base, unix.RENAME_NOREPLACE)
	if err == nil {
		t.name = ""
		return nil
	}
	if !noReplaceUnsupported(err) {
		return os.NewSyscallError("renameat2", err)
	}
	return fmt.Errorf("%w: the file system (%s) supports neither link(2) nor renameat2(RENAME_NOREPLACE); keep the store on one that does (ext4, xfs, btrfs, tmpfs, NFS, Lustre)",
		ErrNoAtomicCreate, fsName(t.dir))
}

// linkUnsupported: link(2) on a file system without hard links.
func linkUnsupported(err error) bool {
	return errors.Is(err, unix.EPERM) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS)
}

// noReplaceUnsupported: renameat2 on a kernel without it (ENOSYS) or a file
// system that does not know the flag (EINVAL).
func noReplaceUnsupported(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP)
}

// fsNames are the statfs magic numbers of file systems worth naming.
var fsNames = map[int64]string{
	0xef53: "ext4", 0x58465342: "xfs", 0x9123683e: "btrfs", 0x01021994: "tmpfs",
	0x858458f6: "ramfs", 0x6969: "nfs", 0x0bd00bd0: "lustre", 0x47504653: "gpfs",
	0x65735546: "fuse", 0x4d44: "vfat", 0x2011bab0: "exfat",
	0xff534d42: "cifs", 0xfe534d42: "smb2", 0x00c36400: "ceph",
}

// fsName names the file system holding the open folder dir.
func fsName(dir int) string {
	var st unix.Statfs_t
	if err := unix.Fstatfs(dir, &st); err != nil {
		return "unknown"
	}
	if name, ok := fsNames[st.Type]; ok {
		return fmt.Sprintf("%s, magic %#x", name, st.Type)
	}
	return fmt.Sprintf("magic %#x", st.Type)
}
