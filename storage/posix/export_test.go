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
	orig := link
	link = func(oldname, newname string) error {
		return &os.LinkError{Op: "link", Old: oldname, New: newname, Err: unix.EPERM}
	}
	t.Cleanup(func() { link = orig })
}
