package prefetch

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// prefault asks the kernel to map the pages of a new buffer in one call
// (MADV_POPULATE_WRITE) before a read fills it: touching fresh memory
// page by page costs a fault per 4 KiB, which for a shard read from the
// page cache takes longer than the copy itself, and in the first epoch
// that CPU is taken from the trainer beside the daemon. A kernel without
// it (before Linux 5.14) faults pages one by one as before.
func prefault(b []byte) {
	const page = 4096
	if len(b) < 16*page {
		return
	}
	off := int((page - uintptr(unsafe.Pointer(unsafe.SliceData(b)))%page) % page) // to the first whole page
	whole := (len(b) - off) &^ (page - 1)
	_ = unix.Madvise(b[off:off+whole], unix.MADV_POPULATE_WRITE)
}
