package posix

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	// BufferSize is the size of each of the two buffers a write holds, and
	// of the blocks it writes.
	BufferSize = 4 << 20
	// alignment satisfies O_DIRECT's rules for buffer address, file offset
	// and length on the block devices and file systems we meet (512 or 4096
	// byte logical blocks; Lustre wants page alignment).
	alignment = 4096
)

// ErrDirectIOUnsupported: the file system refuses O_DIRECT.
var ErrDirectIOUnsupported = errors.New("file system does not support O_DIRECT")

var bufPool = sync.Pool{New: func() any {
	b := alignedBuffer(BufferSize)
	return &b
}}

// alignedBuffer returns n bytes starting at an address that is a multiple of
// alignment, carved out of a slightly larger allocation.
func alignedBuffer(n int) []byte {
	raw := make([]byte, n+alignment)
	off := 0
	if rem := int(uintptr(unsafe.Pointer(&raw[0])) % alignment); rem != 0 {
		off = alignment - rem
	}
	return raw[off : off+n : off+n]
}

func isAligned(p []byte) bool {
	return len(p) == 0 || uintptr(unsafe.Pointer(&p[0]))%alignment == 0
}

// setDirect turns O_DIRECT on or off for an open file. It is a variable so
// tests can simulate a file system that refuses O_DIRECT.
var setDirect = func(f *os.File, on bool) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var opErr error
	err = rc.Control(func(fd uintptr) {
		flags, err := unix.FcntlInt(fd, unix.F_GETFL, 0)
		if err != nil {
			opErr = os.NewSyscallError("fcntl", err)
			return
		}
		if on {
			flags |= unix.O_DIRECT
		} else {
			flags &^= unix.O_DIRECT
		}
		if _, err := unix.FcntlInt(fd, unix.F_SETFL, flags); err != nil {
			opErr = os.NewSyscallError("fcntl", err)
		}
	})
	if err != nil {
		return err
	}
	return opErr
}

// blockWriter writes consecutive blocks to a file, with O_DIRECT while it
// can. O_DIRECT is set with fcntl on the already created file rather than
// at open: an open with O_CREAT|O_DIRECT that fails with EINVAL has already
// created the file.
type blockWriter struct {
	f          *os.File
	off        int64
	direct     bool
	onFallback func() // called when a direct write is refused
}

// startDirect tries to turn on O_DIRECT and reports whether it did.
func (w *blockWriter) startDirect() (bool, error) {
	err := setDirect(w.f, true)
	if errors.Is(err, unix.EINVAL) {
		return false, nil
	}
	w.direct = err == nil
	return w.direct, err
}

// write writes p at the current offset. In direct mode p must be a whole
// number of aligned blocks. A direct write refused with EINVAL (a file
// system that accepted the flag but not our alignment) is redone buffered,
// and the rest of the file is written buffered too.
func (w *blockWriter) write(p []byte) error {
	_, err := w.f.WriteAt(p, w.off)
	if w.direct && errors.Is(err, unix.EINVAL) {
		if w.onFallback != nil {
			w.onFallback()
		}
		if err = w.stopDirect(); err == nil {
			_, err = w.f.WriteAt(p, w.off)
		}
	}
	if err != nil {
		return err
	}
	w.off += int64(len(p))
	return nil
}

// finish writes the last, possibly partial, block: its aligned part with
// O_DIRECT and the tail through the page cache.
func (w *blockWriter) finish(p []byte) error {
	if w.direct {
		n := len(p) &^ (alignment - 1)
		if err := w.write(p[:n]); err != nil {
			return err
		}
		p = p[n:]
		if len(p) > 0 {
			if err := w.stopDirect(); err != nil {
				return err
			}
		}
	}
	if len(p) == 0 {
		return nil
	}
	return w.write(p)
}

func (w *blockWriter) stopDirect() error {
	w.direct = false
	return setDirect(w.f, false)
}

// writeFile copies r into f block by block, checking ctx between blocks and
// the length against size (unless size < 0). It does not sync. Two buffers
// alternate: one is written while the next is read from r, so a drain's
// compression and the device's write overlap instead of taking turns.
func (b *Backend) writeFile(ctx context.Context, f *os.File, r io.Reader, size int64) error {
	bufs := [2]*[]byte{bufPool.Get().(*[]byte), bufPool.Get().(*[]byte)}
	w := &blockWriter{f: f, onFallback: func() { b.directFallback.Add(1) }}
	if err := b.maybeDirect(w, size); err != nil {
		return err
	}
	aw := &asyncWriter{w: w, errc: make(chan error, 1)}
	defer func() {
		_ = aw.wait() // the buffers go back to the pool only once no write uses them
		bufPool.Put(bufs[0])
		bufPool.Put(bufs[1])
	}()
	var read int64
	for i := 0; ; i ^= 1 {
		if err := ctx.Err(); err != nil {
			return err
		}
		buf := *bufs[i]
		n, err := io.ReadFull(r, buf)
		read += int64(n)
		if size >= 0 && read > size {
			return fmt.Errorf("reader yielded more than the %d bytes announced", size)
		}
		if werr := aw.wait(); werr != nil {
			return werr
		}
		switch err {
		case nil:
			aw.start(buf)
		case io.EOF, io.ErrUnexpectedEOF:
			if err := w.finish(buf[:n]); err != nil {
				return err
			}
			if size >= 0 && read != size {
				return fmt.Errorf("reader yielded %d bytes, %d announced", read, size)
			}
			return nil
		default:
			return fmt.Errorf("read: %w", err)
		}
	}
}

// maybeDirect turns on O_DIRECT for large (or unsized) objects.
func (b *Backend) maybeDirect(w *blockWriter, size int64) error {
	if !b.opts.DirectIO || (size >= 0 && size < b.opts.DirectIOThreshold) {
		return nil
	}
	ok, err := w.startDirect()
	if err != nil {
		return err
	}
	if ok {
		b.directWrites.Add(1)
	} else {
		b.directFallback.Add(1)
	}
	return nil
}

// asyncWriter runs one blockWriter.write at a time in the background.
type asyncWriter struct {
	w       *blockWriter
	errc    chan error
	pending bool
}

func (a *asyncWriter) start(p []byte) {
	a.pending = true
	go func() { a.errc <- a.w.write(p) }()
}

func (a *asyncWriter) wait() error {
	if !a.pending {
		return nil
	}
	a.pending = false
	return <-a.errc
}

// WriteDirect writes data to the file path, creating or truncating it, with
// O_DIRECT, and fsyncs it: the raw-write baseline for benchmarks. The part
// of data that is not a whole number of 4096-byte blocks is written through
// the page cache, and data not aligned in memory is copied through an
// aligned buffer first. It fails with ErrDirectIOUnsupported where the file
// system refuses O_DIRECT.
func WriteDirect(path string, data []byte) (err error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o666)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	w := &blockWriter{f: f}
	ok, err := w.startDirect()
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("write %s: %w", path, ErrDirectIOUnsupported)
	}
	if err := writeDirectBody(w, data); err != nil {
		return err
	}
	return f.Sync()
}

func writeDirectBody(w *blockWriter, data []byte) error {
	whole := len(data) &^ (alignment - 1)
	if isAligned(data) {
		if err := w.write(data[:whole]); err != nil {
			return err
		}
		return w.finish(data[whole:])
	}
	bufp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bufp)
	for len(data) > 0 {
		n := copy(*bufp, data)
		data = data[n:]
		if err := w.finish((*bufp)[:n]); err != nil {
			return err
		}
	}
	return nil
}
