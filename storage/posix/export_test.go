package posix

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

var (
	WrapErr    = wrapErr
	IsTempName = isTempName
	TempName   = tempName
)

func (b *Backend) DirectWrites() int64    { return b.directWrites.Load() }
func (b *Backend) DirectFallbacks() int64 { return b.directFallback.Load() }

// SimulateNoDirectIO makes turning on O_DIRECT fail as on a file system
// without it, until the test ends.
func SimulateNoDirectIO(t testing.TB) {
	orig := setDirect
	setDirect = func(f *os.File, on bool) error {
		if on {
			return os.NewSyscallError("fcntl", unix.EINVAL)
		}
		return orig(f, on)
	}
	t.Cleanup(func() { setDirect = orig })
}

// SimulateNoHardLinks makes link(2) fail as on a file system without hard
// links, until the test ends.
func SimulateNoHardLinks(t testing.TB) {
	replace(t, &linkat, func(int, string, int, string, int) error { return unix.EPERM })
}

// SimulateNoRenameNoReplace makes renameat2(RENAME_NOREPLACE) fail as on a
// file system that does not know the flag, until the test ends.
func SimulateNoRenameNoReplace(t testing.TB) {
	replace(t, &renameat2, func(int, string, int, string, uint) error { return unix.EINVAL })
}

// SimulateNoOpenat2 makes openat2 fail as on a kernel before Linux 5.6, for
// the backends created until the test ends.
func SimulateNoOpenat2(t testing.TB) {
	replace(t, &openat2, func(int, string, *unix.OpenHow) (int, error) { return -1, unix.ENOSYS })
}

// SetTempRandom makes the random part of temporary names come from next,
// until the test ends.
func SetTempRandom(t testing.TB, next func() uint64) { replace(t, &tempRandom, next) }

// SetCrashPoint has PutIfAbsent call fn at each of its steps, until the
// test ends.
func SetCrashPoint(t testing.TB, fn func(step string)) { replace(t, &crashPoint, fn) }

// UsesOpenat2 reports whether the backend resolves paths with openat2.
func (b *Backend) UsesOpenat2() bool { return b.openat2 }

func replace[T any](t testing.TB, v *T, with T) {
	orig := *v
	*v = with
	t.Cleanup(func() { *v = orig })
}
