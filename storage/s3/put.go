package s3

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/storage"
)

// S3's multipart limits.
const (
	maxParts      = 10_000
	maxPartSize   = 5 << 30
	maxObjectSize = 5 << 40
	maxSinglePut  = 5 << 30
)

const (
	// partsPerDoubling is how many parts of unknown-size objects go by
	// before the part size doubles (see the package comment).
	partsPerDoubling = 2_500
	// maxDoublings caps the part size at PartSize << maxDoublings.
	maxDoublings = 3
	// readStep is the most Put asks of its reader at once, so that it
	// checks its context at least every readStep bytes.
	readStep = 1 << 20
)

// Put implements storage.Backend; see the package comment for memory and
// atomicity. An object smaller than a part goes up in one PUT, a larger one
// as a multipart upload that is completed only after the reader's EOF (and
// the length check) and aborted on any error.
func (b *Backend) Put(ctx context.Context, name string, r io.Reader, size int64) error {
	key, err := b.key(name)
	if err != nil {
		return fmt.Errorf("s3: put: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return b.opError("put", key, err)
	}
	if size > maxObjectSize {
		return b.opError("put", key, fmt.Errorf("object of %d bytes is larger than S3's limit of 5 TiB", size))
	}
	u := &upload{b: b, key: key, r: &sizedReader{r: r, size: size}}
	if size > int64(maxParts)*b.partSize {
		u.fixed = roundUp((size+maxParts-1)/maxParts, 1<<20)
	}
	return u.run(ctx)
}

// PutIfAbsent implements storage.Backend with a conditional PUT
// (If-None-Match: *). A retry after an attempt whose answer was lost may
// find the object that attempt created; PutIfAbsent then reads it back and
// reports success when it holds exactly data.
func (b *Backend) PutIfAbsent(ctx context.Context, name string, data []byte) error {
	key, err := b.key(name)
	if err != nil {
		return fmt.Errorf("s3: put-if-absent: %w", err)
	}
	if len(data) > maxSinglePut {
		return b.opError("put-if-absent", key, fmt.Errorf("%d bytes is more than one PUT takes (5 GiB)", len(data)))
	}
	opts := putOptions(data)
	opts.SetMatchETagExcept("*")
	attempts := 0
	err = b.do(ctx, "put-if-absent", key, func(ctx context.Context, wd *watchdog) error {
		attempts++
		_, err := b.core.PutObject(ctx, b.bucket, key, progressReader{bytes.NewReader(data), wd}, int64(len(data)), "", "", opts)
		return err
	})
	if errorCode(err) == minio.PreconditionFailed {
		if attempts > 1 && b.holds(ctx, key, data) {
			return nil
		}
		return fmt.Errorf("s3: put-if-absent s3://%s: %w", path(b.bucket, key), storage.ErrExists)
	}
	return err
}

// holds reports whether the object is there with exactly data.
func (b *Backend) holds(ctx context.Context, key string, data []byte) bool {
	rc, err := b.get(ctx, key, 0, -1)
	if err != nil {
		return false
	}
	defer rc.Close()
	got, err := io.ReadAll(io.LimitReader(rc, int64(len(data))+1))
	return err == nil && bytes.Equal(got, data)
}

// upload is one Put.
type upload struct {
	b     *Backend
	key   string
	r     *sizedReader
	fixed int64  // part size when the object is too large for the doubling schedule
	id    string // multipart upload ID

	mu    sync.Mutex
	parts []minio.CompletePart
}

// part is a buffer of data to upload as part num.
type part struct {
	num    int
	buf    *[]byte
	n      int
	pooled bool
}

func (p *part) data() []byte { return (*p.buf)[:p.n] }

func (u *upload) release(p *part) {
	if p != nil && p.pooled {
		u.b.bufs.put(p.buf)
	}
}

// partSize is the size of part num (1-based).
func (u *upload) partSize(num int) int64 {
	if u.fixed > 0 {
		return u.fixed
	}
	return u.b.partSize << min((num-1)/partsPerDoubling, maxDoublings)
}

func (u *upload) run(ctx context.Context) error {
	first, last, err := u.readPart(ctx, 1)
	if err != nil {
		u.release(first)
		return u.b.opError("put", u.key, err)
	}
	if last {
		defer u.release(first)
		return u.putSingle(ctx, first.data())
	}
	return u.multipart(ctx, first)
}

// readPart fills part num from the reader and reports whether it is the
// last. An object known to be smaller than a part gets a buffer of its own
// size rather than a pooled one.
func (u *upload) readPart(ctx context.Context, num int) (p *part, last bool, err error) {
	size := u.partSize(num)
	p = &part{num: num}
	if num == 1 && u.r.size >= 0 && u.r.size < size {
		b := make([]byte, u.r.size)
		p.buf = &b
	} else {
		p.buf, p.pooled = u.b.bufs.get(int(size)), true
	}
	p.n, last, err = u.r.fill(ctx, *p.buf)
	return p, last, err
}

func (u *upload) putSingle(ctx context.Context, data []byte) error {
	opts := putOptions(data)
	return u.b.do(ctx, "put", u.key, func(ctx context.Context, wd *watchdog) error {
		_, err := u.b.core.PutObject(ctx, u.b.bucket, u.key, progressReader{bytes.NewReader(data), wd}, int64(len(data)), "", "", opts)
		return err
	})
}

// Integrity. The store checks every PUT and part against a CRC32C of its
// bytes that travels in a signed header, so a body corrupted on the way is
// refused (and resent: see transientCodes). The payload itself goes
// unsigned: minio-go would otherwise sign it with SHA-256, chunk by chunk
// over plain HTTP, which costs about a core per 1.5 GB/s; CRC32C costs a
// hundredth of that. Over HTTPS, TLS protects the bytes as well.
const (
	checksumHeader    = "X-Amz-Checksum-Crc32c"
	checksumAlgHeader = "X-Amz-Checksum-Algorithm"
	checksumAlg       = "CRC32C"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crc32c returns the CRC32C of p as S3 writes it: base64 of the big-endian
// value.
func crc32c(p []byte) string {
	return base64.StdEncoding.EncodeToString(binary.BigEndian.AppendUint32(nil, crc32.Checksum(p, castagnoli)))
}

// putOptions are the options of a single PUT of data.
func putOptions(data []byte) minio.PutObjectOptions {
	return minio.PutObjectOptions{
		DisableContentSha256: true,
		UserMetadata:         map[string]string{checksumHeader: crc32c(data)},
	}
}

// multipart uploads first and the rest of the reader as parts, up to
// PartConcurrency in memory at once, then completes the upload; on any
// error it aborts it.
func (u *upload) multipart(ctx context.Context, first *part) (err error) {
	err = u.b.do(ctx, "put", u.key, func(ctx context.Context, _ *watchdog) (err error) {
		u.id, err = u.b.core.NewMultipartUpload(ctx, u.b.bucket, u.key, minio.PutObjectOptions{
			UserMetadata: map[string]string{checksumAlgHeader: checksumAlg},
		})
		return err
	})
	if err != nil {
		u.release(first)
		return err
	}
	defer func() {
		if err != nil {
			u.abort(ctx)
		}
	}()
	if err := u.sendParts(ctx, first); err != nil {
		return err
	}
	return u.complete(ctx)
}

// sendParts reads parts and uploads them in parallel. Each part holds a
// slot from the moment its buffer is taken until its upload ends, so at
// most PartConcurrency buffers are in use.
func (u *upload) sendParts(ctx context.Context, first *part) error {
	sendCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(sendCtx)
	slots := make(chan struct{}, u.b.partConc)
	slots <- struct{}{}
	p, last := first, false
	var readErr error
send:
	for {
		cur := p
		g.Go(func() error {
			defer func() { u.release(cur); <-slots }()
			return u.sendPart(gctx, cur)
		})
		switch {
		case last:
			break send
		case p.num == maxParts:
			readErr = fmt.Errorf("object needs more than %d parts of up to %d bytes", maxParts, u.partSize(maxParts))
			break send
		}
		select {
		case slots <- struct{}{}:
		case <-gctx.Done():
			readErr = gctx.Err()
			break send
		}
		next, isLast, err := u.readPart(gctx, p.num+1)
		if err != nil || next.n == 0 && isLast {
			u.release(next)
			<-slots
			readErr = err
			break
		}
		p, last = next, isLast
	}
	if readErr != nil && !errors.Is(readErr, context.Canceled) {
		cancel() // the reader failed: stop the uploads in flight
	}
	werr := g.Wait()
	switch {
	case ctx.Err() != nil:
		return u.b.opError("put", u.key, ctx.Err())
	case readErr != nil && !errors.Is(readErr, context.Canceled):
		return u.b.opError("put", u.key, readErr)
	case werr != nil:
		return werr
	}
	return readErr
}

func (u *upload) sendPart(ctx context.Context, p *part) error {
	data := p.data()
	sum := crc32c(data)
	opts := minio.PutObjectPartOptions{
		DisableContentSha256: true,
		CustomHeader:         http.Header{checksumHeader: {sum}, checksumAlgHeader: {checksumAlg}},
	}
	var op minio.ObjectPart
	err := u.b.do(ctx, "put", u.key, func(ctx context.Context, wd *watchdog) (err error) {
		op, err = u.b.core.PutObjectPart(ctx, u.b.bucket, u.key, u.id, p.num,
			progressReader{bytes.NewReader(data), wd}, int64(len(data)), opts)
		return err
	})
	if err != nil {
		return err
	}
	u.mu.Lock()
	u.parts = append(u.parts, minio.CompletePart{PartNumber: p.num, ETag: op.ETag, ChecksumCRC32C: sum})
	u.mu.Unlock()
	return nil
}

// complete publishes the object. If an attempt's answer is lost and the
// next finds the upload gone, the object is checked instead: only
// completing or aborting removes an upload, and nothing aborts ours.
func (u *upload) complete(ctx context.Context) error {
	slices.SortFunc(u.parts, func(a, b minio.CompletePart) int { return a.PartNumber - b.PartNumber })
	attempts := 0
	return u.b.do(ctx, "put", u.key, func(ctx context.Context, _ *watchdog) error {
		attempts++
		_, err := u.b.core.CompleteMultipartUpload(ctx, u.b.bucket, u.key, u.id, u.parts, minio.PutObjectOptions{})
		if err != nil && attempts > 1 && errorCode(err) == minio.NoSuchUpload {
			if info, serr := u.b.client.StatObject(ctx, u.b.bucket, u.key, minio.StatObjectOptions{}); serr == nil && info.Size == u.r.n {
				return nil
			}
		}
		return err
	})
}

// abort removes the upload's parts. It runs even when ctx is cancelled
// (that is often why it runs), within the retry deadline; if it still
// fails, the parts stay until a lifecycle rule removes them, and a warning
// says so.
func (u *upload) abort(ctx context.Context) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), u.b.retry.Deadline)
	defer cancel()
	err := u.b.do(actx, "abort", u.key, func(ctx context.Context, _ *watchdog) error {
		err := u.b.core.AbortMultipartUpload(ctx, u.b.bucket, u.key, u.id)
		if errorCode(err) == minio.NoSuchUpload {
			return nil
		}
		return err
	})
	if err != nil {
		u.b.log.Warn("s3: could not abort a failed multipart upload; its parts stay until a lifecycle rule removes them",
			"object", "s3://"+path(u.b.bucket, u.key), "upload_id", u.id, "err", err)
	}
}

// sizedReader counts what it reads and, when size >= 0, fails as soon as
// the stream turns out longer or shorter than size.
type sizedReader struct {
	r    io.Reader
	size int64 // -1: unknown
	n    int64
}

func (s *sizedReader) Read(p []byte) (int, error) {
	if s.size >= 0 {
		if s.n == s.size {
			return 0, s.probe()
		}
		p = p[:min(int64(len(p)), s.size-s.n)]
	}
	n, err := s.r.Read(p)
	s.n += int64(n)
	if err == io.EOF && s.size >= 0 && s.n < s.size {
		return n, fmt.Errorf("reader yielded %d bytes, %d announced", s.n, s.size)
	}
	if err != nil && err != io.EOF {
		err = fmt.Errorf("read: %w", err)
	}
	return n, err
}

// probe checks that a reader that gave its announced size is at its end.
func (s *sizedReader) probe() error {
	var one [1]byte
	for {
		n, err := s.r.Read(one[:])
		switch {
		case n > 0:
			return fmt.Errorf("reader yielded more than the %d bytes announced", s.size)
		case err == io.EOF:
			return io.EOF
		case err != nil:
			return fmt.Errorf("read: %w", err)
		}
	}
}

// fill reads into buf until it is full or the stream ends, in steps of at
// most readStep with a look at ctx before each. It reports whether the
// stream ended; a full buffer of a stream of known size that ends exactly
// there counts as the end too, so such an object needs no empty last part.
func (s *sizedReader) fill(ctx context.Context, buf []byte) (n int, eof bool, err error) {
	for n < len(buf) {
		if err := ctx.Err(); err != nil {
			return n, false, err
		}
		m, err := s.Read(buf[n:min(len(buf), n+readStep)])
		n += m
		if err == io.EOF {
			return n, true, nil
		}
		if err != nil {
			return n, false, err
		}
	}
	if s.size >= 0 && s.n == s.size {
		if err := s.probe(); err != io.EOF {
			return n, false, err
		}
		return n, true, nil
	}
	return n, false, nil
}

// bufPool holds idle part buffers for all of a backend's Puts, one
// sync.Pool per size, so the garbage collector can reclaim them when Puts
// stop.
type bufPool struct {
	mu    sync.Mutex
	pools map[int]*sync.Pool
	inUse atomic.Int64 // buffers handed out and not yet returned
	peak  atomic.Int64 // the most inUse has been (tests)
}

func (bp *bufPool) pool(size int) *sync.Pool {
	bp.mu.Lock()
	defer bp.mu.Unlock()
	if bp.pools == nil {
		bp.pools = map[int]*sync.Pool{}
	}
	p := bp.pools[size]
	if p == nil {
		p = &sync.Pool{New: func() any { b := make([]byte, size); return &b }}
		bp.pools[size] = p
	}
	return p
}

func (bp *bufPool) get(size int) *[]byte {
	n := bp.inUse.Add(1)
	for p := bp.peak.Load(); n > p && !bp.peak.CompareAndSwap(p, n); p = bp.peak.Load() {
	}
	return bp.pool(size).Get().(*[]byte)
}

func (bp *bufPool) put(b *[]byte) {
	bp.inUse.Add(-1)
	bp.pool(cap(*b)).Put(b)
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }
