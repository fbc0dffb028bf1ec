package s3

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/minio/minio-go/v7"
)

// RetryPolicy bounds the retries of one request: waits grow from Initial,
// doubling up to Max, each drawn uniformly from [0, wait] (full jitter, so
// that many clients throttled at once do not come back in step), until
// Deadline has passed since the first attempt.
type RetryPolicy struct {
	Initial  time.Duration // default 200ms
	Max      time.Duration // default 10s
	Deadline time.Duration // default 2 minutes
}

func (p *RetryPolicy) setDefaults() {
	if p.Initial <= 0 {
		p.Initial = 200 * time.Millisecond
	}
	if p.Max <= 0 {
		p.Max = 10 * time.Second
	}
	if p.Deadline <= 0 {
		p.Deadline = 2 * time.Minute
	}
}

// backoff paces the attempts of one request.
type backoff struct {
	p       RetryPolicy
	start   time.Time
	attempt int
}

func (b *Backend) newBackoff() *backoff {
	return &backoff{p: b.retry, start: time.Now()}
}

// wait sleeps before the next attempt. It returns false, at once, when the
// deadline would pass first or ctx ends.
func (bo *backoff) wait(ctx context.Context) bool {
	ceil := bo.p.Initial << min(bo.attempt, 30)
	if ceil > bo.p.Max || ceil <= 0 {
		ceil = bo.p.Max
	}
	bo.attempt++
	d := rand.N(ceil + 1)
	if time.Since(bo.start)+d > bo.p.Deadline {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// do runs fn, one request, until it succeeds, fails permanently, or the
// retry deadline passes. Each attempt gets its own context, cancelled by a
// watchdog when the attempt stalls. Errors come back mapped and wrapped by
// opError.
func (b *Backend) do(ctx context.Context, op, key string, fn func(ctx context.Context, wd *watchdog) error) error {
	bo := b.newBackoff()
	for {
		if err := ctx.Err(); err != nil {
			return b.opError(op, key, err)
		}
		actx, wd := b.startAttempt(ctx, true)
		err := wd.result(fn(actx, wd))
		wd.stop()
		if err == nil {
			return nil
		}
		if !b.retryable(ctx, bo, op, key, err) {
			return b.opError(op, key, err)
		}
	}
}

// retryable reports whether a failed attempt is worth another, and waits
// for it if so.
func (b *Backend) retryable(ctx context.Context, bo *backoff, op, key string, err error) bool {
	if ctx.Err() != nil || !isTransient(err) && !spuriousDenial(op, bo, err) {
		return false
	}
	b.log.Warn("s3 request failed; retrying", "op", op, "object", "s3://"+path(b.bucket, key),
		"endpoint", b.endpoint, "attempt", bo.attempt+1, "err", err)
	return bo.wait(ctx)
}

// spuriousDenial reports an AccessDenied on a write worth one more try.
// MinIO on a single drive answers AccessDenied when a delete removes an
// object's parent path while another object is being written under it; the
// bucket and credentials were checked when the backend opened, so a
// denial of a put or delete is retried once before it counts as real.
func spuriousDenial(op string, bo *backoff, err error) bool {
	return bo.attempt == 0 && (op == "put" || op == "delete") && errorCode(err) == minio.AccessDenied
}

// errStalled is the cause of an attempt the watchdog cancelled.
var errStalled = errors.New("request made no progress")

// watchdog cancels an attempt that has been waiting on the network without
// progress for the stall timeout. It checks a timestamp rather than
// resetting a timer per read, since kicks come at every 32 KiB of a body.
// While paused (the caller holds a response body but is not reading it) the
// clock does not run.
type watchdog struct {
	d      time.Duration
	base   time.Time
	last   atomic.Int64 // nanoseconds since base of the last progress
	active atomic.Bool
	cancel context.CancelCauseFunc
	actx   context.Context
	mu     sync.Mutex
	timer  *time.Timer
}

// startAttempt returns an attempt's context and its watchdog, running
// when active.
func (b *Backend) startAttempt(ctx context.Context, active bool) (context.Context, *watchdog) {
	actx, cancel := context.WithCancelCause(ctx)
	wd := &watchdog{d: b.stall, base: time.Now(), cancel: cancel, actx: actx}
	wd.active.Store(active)
	wd.mu.Lock()
	wd.timer = time.AfterFunc(wd.d, wd.check)
	wd.mu.Unlock()
	return actx, wd
}

func (wd *watchdog) now() int64 { return int64(time.Since(wd.base)) }

// kick records progress.
func (wd *watchdog) kick() { wd.last.Store(wd.now()) }

// resume starts the clock, as of now.
func (wd *watchdog) resume() {
	wd.kick()
	wd.active.Store(true)
}

// pause stops the clock.
func (wd *watchdog) pause() {
	wd.kick()
	wd.active.Store(false)
}

func (wd *watchdog) check() {
	idle := time.Duration(wd.now() - wd.last.Load())
	if wd.active.Load() && idle >= wd.d {
		wd.cancel(errStalled)
		return
	}
	next := wd.d - idle
	if !wd.active.Load() || next <= 0 {
		next = wd.d
	}
	wd.mu.Lock()
	if wd.timer != nil {
		wd.timer.Reset(next)
	}
	wd.mu.Unlock()
}

// stop ends the attempt: its context is cancelled, which releases a
// response body still open.
func (wd *watchdog) stop() {
	wd.mu.Lock()
	if wd.timer != nil {
		wd.timer.Stop()
		wd.timer = nil
	}
	wd.mu.Unlock()
	wd.cancel(context.Canceled)
}

// result replaces the error of an attempt the watchdog cancelled with
// errStalled, so that it is retried (a cancellation of the caller's own
// context is not).
func (wd *watchdog) result(err error) error {
	if err != nil && errors.Is(context.Cause(wd.actx), errStalled) {
		return fmt.Errorf("%w for %v", errStalled, wd.d)
	}
	return err
}

// progressReader kicks a watchdog as a request body is sent. It hides the
// reader's Seek, so minio-go never retries on its own.
type progressReader struct {
	r  io.Reader
	wd *watchdog
}

func (p progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.wd.kick()
	return n, err
}

// transientCodes are S3 error codes worth retrying.
var transientCodes = map[string]bool{
	"SlowDown": true, "SlowDownRead": true, "SlowDownWrite": true,
	"Throttling": true, "ThrottlingException": true, "RequestLimitExceeded": true,
	"RequestThrottled": true, "TooManyRequests": true,
	"RequestTimeout": true, "RequestTimeTooSkewed": false,
	"InternalError": true, "ServiceUnavailable": true,
	"XMinioServerNotInitialized": true, "XMinioReadQuorum": true, "XMinioWriteQuorum": true,
	"ExpiredToken": true, "ExpiredTokenException": true,
	// A body damaged on the way (it failed its checksum): send it again.
	"BadDigest": true, "XAmzContentChecksumMismatch": true, "XAmzContentSHA256Mismatch": true,
	"IncompleteBody": true,
	// A concurrent conditional write on the same key (AWS): try again.
	"ConditionalRequestConflict": true,
	"OperationAborted":           true,
}

// transportTimeout reports a timeout of the HTTP transport itself: no
// response headers within the stall timeout (ResponseHeaderTimeout), a
// dial or TLS handshake that timed out. Such an error also matches
// context.DeadlineExceeded (net/http says so of its header timeout), but
// it is a frozen endpoint, not the caller's deadline, whose error is the
// context's own.
func transportTimeout(err error) bool {
	var urlErr *url.Error
	if !errors.As(err, &urlErr) || urlErr.Err == nil || urlErr.Err == context.DeadlineExceeded || urlErr.Err == context.Canceled {
		return false
	}
	var t interface{ Timeout() bool }
	return errors.As(urlErr.Err, &t) && t.Timeout()
}

// isTransient reports whether err is worth retrying: throttling, server
// errors, and network failures, but not a certificate problem or a
// cancellation by the caller.
func isTransient(err error) bool {
	if errors.Is(err, errStalled) || transportTimeout(err) {
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var er minio.ErrorResponse
	if errors.As(err, &er) {
		if t, ok := transientCodes[er.Code]; ok {
			return t
		}
		switch er.StatusCode {
		case 408, 429, 499, 500, 502, 503, 504, 520:
			return true
		}
		return false
	}
	var ce *x509.CertificateInvalidError
	var ue x509.UnknownAuthorityError
	var he x509.HostnameError
	if errors.As(err, &ce) || errors.As(err, &ue) || errors.As(err, &he) {
		return false
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		// A name that does not exist is a wrong endpoint, not an outage.
		return !dnsErr.IsNotFound
	}
	var urlErr *url.Error
	var netErr net.Error
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.ETIMEDOUT), errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH):
		return true
	case errors.As(err, &urlErr):
		// Transport failures (minio-go rewrites some of them as plain
		// strings) other than the TLS ones above.
		return urlErr.Err == nil || urlErr.Err.Error() != "http: server gave HTTP response to HTTPS client"
	case errors.As(err, &netErr):
		return true
	}
	return false
}
