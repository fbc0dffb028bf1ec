package s3

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/minio/minio-go/v7"
)

// errReplaced: the object changed while a Get was reading it.
var errReplaced = errors.New("object replaced while being read")

// Get implements storage.Backend with one ranged GET. The reader streams
// the response body; if the connection fails midway it reopens the rest of
// the range, pinned to the ETag it first saw, so it never mixes two
// versions of an object (it fails instead if the object was replaced).
func (b *Backend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	key, err := b.key(name)
	if err != nil {
		return nil, fmt.Errorf("s3: get: %w", err)
	}
	if offset < 0 {
		return nil, b.opError("get", key, fmt.Errorf("negative offset %d", offset))
	}
	return b.get(ctx, key, offset, length)
}

func (b *Backend) get(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	if err := ctx.Err(); err != nil {
		return nil, b.opError("get", key, err)
	}
	if length == 0 {
		// Nothing to read, but a missing object is still an error.
		if _, err := b.stat(ctx, "get", key); err != nil {
			return nil, err
		}
		return io.NopCloser(eofReader{}), nil
	}
	r := &objectReader{b: b, ctx: ctx, key: key, off: offset, end: -1}
	if length > 0 {
		r.end = offset + length
	}
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

// objectReader reads [off, end) of an object (end < 0: to its end).
type objectReader struct {
	b    *Backend
	ctx  context.Context
	key  string
	off  int64 // next byte to read
	end  int64
	etag string // of the version being read, once known
	body io.ReadCloser
	wd   *watchdog // the open request's; paused between Reads
	bo   *backoff  // retries since the last progress
	done bool
}

func (r *objectReader) backoff() *backoff {
	if r.bo == nil {
		r.bo = r.b.newBackoff()
	}
	return r.bo
}

func (r *objectReader) rangeHeader() string {
	switch {
	case r.end >= 0:
		return fmt.Sprintf("bytes=%d-%d", r.off, r.end-1)
	case r.off > 0:
		return fmt.Sprintf("bytes=%d-", r.off)
	}
	return ""
}

// open sends the GET for the rest of the range, retrying transient
// failures. A range that starts at or past the end (416) reads as empty.
func (r *objectReader) open() error {
	for {
		if err := r.ctx.Err(); err != nil {
			return r.b.opError("get", r.key, err)
		}
		actx, wd := r.b.startAttempt(r.ctx, true)
		opts := minio.GetObjectOptions{}
		if h := r.rangeHeader(); h != "" {
			opts.Set("Range", h)
		}
		if r.etag != "" {
			_ = opts.SetMatchETag(r.etag)
		}
		body, info, _, err := r.b.core.GetObject(actx, r.b.bucket, r.key, opts)
		if err = wd.result(err); err == nil {
			wd.pause()
			if r.etag == "" {
				r.etag = info.ETag
			}
			r.body, r.wd = body, wd
			return nil
		}
		wd.stop()
		var er minio.ErrorResponse
		errors.As(err, &er)
		switch {
		case er.Code == minio.InvalidRange || er.StatusCode == http.StatusRequestedRangeNotSatisfiable:
			r.done = true
			return nil
		case r.etag != "" && er.Code == minio.PreconditionFailed:
			return r.b.opError("get", r.key, errReplaced)
		}
		if !r.b.retryable(r.ctx, r.backoff(), "get", r.key, err) {
			return r.b.opError("get", r.key, err)
		}
	}
}

func (r *objectReader) Read(p []byte) (int, error) {
	for {
		if r.done || r.end >= 0 && r.off >= r.end {
			return 0, io.EOF
		}
		if r.body == nil {
			if err := r.open(); err != nil {
				return 0, err
			}
			continue
		}
		r.wd.resume()
		n, err := r.body.Read(p)
		r.wd.pause()
		r.off += int64(n)
		if n > 0 {
			r.bo = nil
		}
		switch err {
		case nil:
			return n, nil
		case io.EOF:
			r.done = true
			return n, io.EOF
		}
		err = r.wd.result(err)
		r.closeBody()
		if !r.b.retryable(r.ctx, r.backoff(), "get", r.key, err) {
			return n, r.b.opError("get", r.key, err)
		}
		if n > 0 {
			return n, nil
		}
	}
}

func (r *objectReader) closeBody() {
	if r.body != nil {
		r.body.Close()
		r.wd.stop()
		r.body, r.wd = nil, nil
	}
}

// Close releases the connection.
func (r *objectReader) Close() error {
	r.closeBody()
	return nil
}
