package s3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/minio/minio-go/v7"
)

func TestEndpointURL(t *testing.T) {
	t.Setenv("AWS_ENDPOINT_URL_S3", "")
	t.Setenv("AWS_ENDPOINT_URL", "")
	tests := []struct {
		raw, want, errHas string
	}{
		{raw: "http://127.0.0.1:9000", want: "http://127.0.0.1:9000"},
		{raw: "https://s3.example.com/", want: "https://s3.example.com"},
		{raw: "", want: "https://s3.amazonaws.com"},
		{raw: "127.0.0.1:9000", errHas: "http:// or https://"},
		{raw: "ftp://host", errHas: "http:// or https://"},
		{raw: "http://", errHas: "no host"},
		{raw: "http://host/path", errHas: "only a scheme and host"},
		{raw: "http://host?x=1", errHas: "only a scheme and host"},
		{raw: "http://key:s3cr3t@host", errHas: "without credentials"},
	}
	for _, tt := range tests {
		u, err := endpointURL(tt.raw)
		if tt.errHas != "" {
			if err == nil || !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("endpointURL(%q) = %v, want an error containing %q", tt.raw, err, tt.errHas)
			}
			if err != nil && strings.Contains(err.Error(), "s3cr3t") {
				t.Errorf("endpointURL error repeats a secret: %v", err)
			}
			continue
		}
		if err != nil || u.Scheme+"://"+u.Host != tt.want {
			t.Errorf("endpointURL(%q) = %v, %v; want %s", tt.raw, u, err, tt.want)
		}
	}
}

func TestEndpointFromEnv(t *testing.T) {
	t.Setenv("AWS_ENDPOINT_URL", "http://general:1")
	t.Setenv("AWS_ENDPOINT_URL_S3", "")
	if u, _ := endpointURL(""); u.Host != "general:1" {
		t.Errorf("AWS_ENDPOINT_URL not used: %v", u)
	}
	t.Setenv("AWS_ENDPOINT_URL_S3", "https://specific:2")
	if u, _ := endpointURL(""); u.Host != "specific:2" || u.Scheme != "https" {
		t.Errorf("AWS_ENDPOINT_URL_S3 not preferred: %v", u)
	}
	if u, _ := endpointURL("http://flag:3"); u.Host != "flag:3" {
		t.Errorf("explicit endpoint not preferred: %v", u)
	}
}

func TestRegionFromEnv(t *testing.T) {
	t.Setenv("AWS_REGION", "")
	t.Setenv("AWS_DEFAULT_REGION", "eu-west-1")
	if r := regionOr(""); r != "eu-west-1" {
		t.Errorf("regionOr = %q", r)
	}
	t.Setenv("AWS_REGION", "us-west-2")
	if r := regionOr(""); r != "us-west-2" {
		t.Errorf("regionOr = %q", r)
	}
	if r := regionOr("ap-south-1"); r != "ap-south-1" {
		t.Errorf("regionOr = %q", r)
	}
}

func TestIsTransient(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{minio.ErrorResponse{Code: "SlowDown", StatusCode: 503}, true},
		{minio.ErrorResponse{Code: "ServiceUnavailable", StatusCode: 503}, true},
		{minio.ErrorResponse{Code: "InternalError", StatusCode: 500}, true},
		{minio.ErrorResponse{Code: "ThrottlingException", StatusCode: 400}, true},
		{minio.ErrorResponse{Code: "RequestTimeout", StatusCode: 400}, true},
		{minio.ErrorResponse{Code: "Whatever", StatusCode: 502}, true},
		{minio.ErrorResponse{StatusCode: 429}, true},
		{minio.ErrorResponse{Code: "XMinioServerNotInitialized", StatusCode: 503}, true},
		{minio.ErrorResponse{Code: "AccessDenied", StatusCode: 403}, false},
		{minio.ErrorResponse{Code: "InvalidAccessKeyId", StatusCode: 403}, false},
		{minio.ErrorResponse{Code: "SignatureDoesNotMatch", StatusCode: 403}, false},
		{minio.ErrorResponse{Code: "NoSuchBucket", StatusCode: 404}, false},
		{minio.ErrorResponse{Code: "NoSuchKey", StatusCode: 404}, false},
		{minio.ErrorResponse{Code: "PreconditionFailed", StatusCode: 412}, false},
		{fmt.Errorf("wrapped: %w", minio.ErrorResponse{Code: "SlowDown", StatusCode: 503}), true},
		{&url.Error{Op: "Put", URL: "http://x", Err: &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}}, true},
		{&net.OpError{Op: "read", Err: syscall.ECONNRESET}, true},
		{io.ErrUnexpectedEOF, true},
		{&url.Error{Op: "Get", URL: "http://x", Err: errors.New("Connection closed by foreign host http://x. Retry again.")}, true},
		{&url.Error{Op: "Get", URL: "https://x", Err: errors.New("http: server gave HTTP response to HTTPS client")}, false},
		{&url.Error{Op: "Get", URL: "http://x", Err: &net.DNSError{Err: "no such host", Name: "x", IsNotFound: true}}, false},
		{&net.DNSError{Err: "timeout", Name: "x", IsTimeout: true}, true},
		{fmt.Errorf("%w for 1s", errStalled), true},
		{context.Canceled, false},
		{context.DeadlineExceeded, false},
		{&url.Error{Op: "Get", URL: "http://x", Err: context.Canceled}, false},
		{&url.Error{Op: "Get", URL: "http://x", Err: context.DeadlineExceeded}, false}, // the caller's deadline
		{headerTimeout(t), true},                                                       // a frozen endpoint: no headers within the stall timeout
		{errors.New("reader failed"), false},
	}
	for _, tt := range tests {
		if got := isTransient(tt.err); got != tt.want {
			t.Errorf("isTransient(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// headerTimeout is the error net/http gives a request whose response
// headers do not come within ResponseHeaderTimeout, from a real server
// that never answers.
func headerTimeout(t *testing.T) error {
	t.Helper()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-release }))
	defer srv.Close()
	defer close(release)
	c := &http.Client{Transport: &http.Transport{ResponseHeaderTimeout: 50 * time.Millisecond}}
	resp, err := c.Get(srv.URL)
	if err == nil {
		resp.Body.Close()
		t.Fatal("a server that never answers answered")
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("net/http's header timeout %v no longer matches context.DeadlineExceeded: the test needs another case", err)
	}
	return err
}

func TestBackoffDeadline(t *testing.T) {
	// Bounds are loose on purpose: a loaded CI machine oversleeps, and
	// what matters is that the loop retries several times, then stops.
	const deadline = 100 * time.Millisecond
	bo := &backoff{p: RetryPolicy{Initial: time.Millisecond, Max: 4 * time.Millisecond, Deadline: deadline}, start: time.Now()}
	n := 0
	for bo.wait(context.Background()) {
		n++
		if n > 1000 {
			t.Fatal("backoff never gave up")
		}
	}
	if el := time.Since(bo.start); el > deadline+testtime.Scale(5*time.Second) || n < 2 {
		t.Errorf("gave up after %d waits and %v, want several waits, then a stop soon after the %v deadline", n, el, deadline)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	bo = &backoff{p: RetryPolicy{Initial: time.Second, Max: time.Second, Deadline: time.Hour}, start: time.Now()}
	if bo.wait(ctx) {
		t.Error("backoff waited through a cancelled context")
	}
}

func TestPartSizeSchedule(t *testing.T) {
	u := &upload{b: &Backend{partSize: DefaultPartSize}}
	var total int64
	for num := 1; num <= maxParts; num++ {
		total += u.partSize(num)
	}
	if u.partSize(1) != 16<<20 || u.partSize(2500) != 16<<20 || u.partSize(2501) != 32<<20 || u.partSize(maxParts) != 128<<20 {
		t.Errorf("schedule: %d %d %d %d", u.partSize(1), u.partSize(2500), u.partSize(2501), u.partSize(maxParts))
	}
	if total < 580<<30 {
		t.Errorf("10000 parts hold only %d GiB", total>>30)
	}
}

func TestSizedReader(t *testing.T) {
	data := bytes.Repeat([]byte("x"), 100)
	tests := []struct {
		size   int64
		buf    int
		n      int
		eof    bool
		errHas string
	}{
		{size: -1, buf: 200, n: 100, eof: true},
		{size: -1, buf: 100, n: 100, eof: false}, // can't tell yet
		{size: 100, buf: 100, n: 100, eof: true},
		{size: 100, buf: 200, n: 100, eof: true},
		{size: 50, buf: 100, errHas: "more than the 50 bytes"},
		{size: 150, buf: 200, errHas: "yielded 100 bytes, 150 announced"},
		{size: 0, buf: 0, errHas: "more than the 0 bytes"},
	}
	for _, tt := range tests {
		s := &sizedReader{r: bytes.NewReader(data), size: tt.size}
		n, eof, err := s.fill(context.Background(), make([]byte, tt.buf))
		if tt.errHas != "" {
			if err == nil || !strings.Contains(err.Error(), tt.errHas) {
				t.Errorf("size %d buf %d: err %v, want %q", tt.size, tt.buf, err, tt.errHas)
			}
			continue
		}
		if err != nil || n != tt.n || eof != tt.eof {
			t.Errorf("size %d buf %d: fill = %d, %v, %v; want %d, %v", tt.size, tt.buf, n, eof, err, tt.n, tt.eof)
		}
	}
}
