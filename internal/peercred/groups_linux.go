package peercred

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// peerGroups returns the peer's supplementary groups (SO_PEERGROUPS,
// Linux 4.13+), or nil when the kernel cannot say.
func peerGroups(fd int) []int {
	buf := make([]uint32, 64)
	for range 3 {
		n := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		if errno == unix.ERANGE {
			buf = make([]uint32, n/4+1) // n says how much it needs
			continue
		}
		if errno != 0 {
			return nil
		}
		out := make([]int, n/4)
		for i := range out {
			out[i] = int(buf[i])
		}
		return out
	}
	return nil
}
