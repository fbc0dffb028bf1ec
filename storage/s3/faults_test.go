package s3_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7/pkg/credentials"
	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
)

func randomBytes(seed uint64, n int) []byte {
	var key [32]byte
	key[0] = byte(seed)
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

// retryCounter is a slog handler that counts the backend's retry warnings.
type retryCounter struct {
	n atomic.Int64
}

func (c *retryCounter) Enabled(context.Context, slog.Level) bool { return true }
func (c *retryCounter) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "retrying") {
		c.n.Add(1)
	}
	return nil
}
func (c *retryCounter) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c *retryCounter) WithGroup(string) slog.Handler      { return c }

func mustGetAll(t *testing.T, b storage.Backend, name string, offset, length int64) []byte {
	t.Helper()
	rc, err := b.Get(t.Context(), name, offset, length)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("read %s: %v", name, err)
	}
	return data
}

// fault is what faultProxy does to one request.
type fault int

const (
	pass         fault = iota
	slowDown           // 503 SlowDown, request not forwarded
	internal           // 500 InternalError, not forwarded
	reset              // connection closed, not forwarded
	truncate           // forwarded; the response body is cut short
	dropResponse       // forwarded; the response never arrives
	corrupt            // forwarded with a byte of the request body flipped
)

// faultProxy sits between the backend and a real MinIO and breaks the
// requests pick chooses, the way a flaky network or an overloaded store
// would. It is not a fake: every request that gets through is served by
// MinIO.
type faultProxy struct {
	*httptest.Server
	rp       *httputil.ReverseProxy
	mu       sync.Mutex
	pick     func(r *http.Request, n int) fault
	n        int
	injected map[fault]int
}

func newFaultProxy(t *testing.T, target string, pick func(r *http.Request, n int) fault) *faultProxy {
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p := &faultProxy{rp: httputil.NewSingleHostReverseProxy(u), pick: pick, injected: map[fault]int{}}
	p.rp.ErrorLog = nil
	p.Server = httptest.NewServer(p)
	t.Cleanup(p.Close)
	return p
}

func (p *faultProxy) count(f fault) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.injected[f]
}

func (p *faultProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	p.n++
	f := p.pick(r, p.n)
	p.injected[f]++
	p.mu.Unlock()
	switch f {
	case slowDown:
		writeS3Error(w, http.StatusServiceUnavailable, "SlowDown", "Please reduce your request rate.")
	case internal:
		writeS3Error(w, http.StatusInternalServerError, "InternalError", "We encountered an internal error.")
	case reset:
		closeConn(w)
	case truncate:
		p.rp.ServeHTTP(&truncatingWriter{ResponseWriter: w, left: 1000}, r)
	case dropResponse:
		p.rp.ServeHTTP(httptest.NewRecorder(), r)
		closeConn(w)
	case corrupt:
		r.Body = &flipReader{r: r.Body, at: 100}
		p.rp.ServeHTTP(w, r)
	default:
		p.rp.ServeHTTP(w, r)
	}
}

func writeS3Error(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(status)
	fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>%s</Message><RequestId>fault</RequestId></Error>`, code, msg)
}

func closeConn(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		conn.Close()
	}
}

// truncatingWriter passes on the headers and the first left bytes of the
// body, then aborts the connection.
type truncatingWriter struct {
	http.ResponseWriter
	left int
}

func (tw *truncatingWriter) Write(p []byte) (int, error) {
	if len(p) <= tw.left {
		tw.left -= len(p)
		return tw.ResponseWriter.Write(p)
	}
	_, _ = tw.ResponseWriter.Write(p[:tw.left])
	_ = http.NewResponseController(tw.ResponseWriter).Flush()
	panic(http.ErrAbortHandler)
}

// flipReader flips the byte at offset at.
type flipReader struct {
	r   io.ReadCloser
	off int
	at  int
}

func (f *flipReader) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if i := f.at - f.off; i >= 0 && i < n {
		p[i] ^= 0x5a
	}
	f.off += n
	return n, err
}

func (f *flipReader) Close() error { return f.r.Close() }

// TestCorruptUploadsResent: the store refuses a PUT or part whose body
// was damaged on the way (it fails its CRC32C), and the backend sends it
// again.
func TestCorruptUploadsResent(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	var corrupted atomic.Int64
	proxy := newFaultProxy(t, srv.Endpoint(), func(r *http.Request, n int) fault {
		if r.Method == http.MethodPut && r.ContentLength > 1000 && corrupted.Add(1) <= 2 {
			return corrupt
		}
		return pass
	})
	var retries retryCounter
	b := open(t, srv, bucket, "", func(c *s3.Config) {
		c.Endpoint = proxy.URL
		c.Logger = slog.New(&retries)
	})
	ctx := t.Context()
	small := randomBytes(7, 100_000)
	if err := b.Put(ctx, "small", bytes.NewReader(small), int64(len(small))); err != nil {
		t.Fatal(err)
	}
	big := randomBytes(8, 12<<20)
	if err := b.Put(ctx, "big", bytes.NewReader(big), -1); err != nil {
		t.Fatal(err)
	}
	if proxy.count(corrupt) != 2 || retries.n.Load() < 2 {
		t.Fatalf("%d bodies corrupted, %d retries; want 2 and 2", proxy.count(corrupt), retries.n.Load())
	}
	if got := mustGetAll(t, b, "small", 0, -1); !bytes.Equal(got, small) {
		t.Fatal("small object differs")
	}
	if got := mustGetAll(t, b, "big", 0, -1); !bytes.Equal(got, big) {
		t.Fatal("big object differs")
	}
	srv.CheckNoUploads(t, bucket)
}

// TestRetriesThroughFaults runs every operation through a proxy that fails
// a third of the requests in all the transient ways; each must succeed.
func TestRetriesThroughFaults(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	cycle := []fault{slowDown, internal, reset, truncate}
	proxy := newFaultProxy(t, srv.Endpoint(), func(r *http.Request, n int) fault {
		if n%3 != 0 {
			return pass
		}
		f := cycle[(n/3)%len(cycle)]
		if f == truncate && r.Method != http.MethodGet {
			return reset
		}
		return f
	})
	var retries retryCounter
	b := open(t, srv, bucket, "faulty", func(c *s3.Config) {
		c.Endpoint = proxy.URL
		c.Retry = s3.RetryPolicy{Initial: time.Millisecond, Max: 20 * time.Millisecond, Deadline: 30 * time.Second}
		c.Logger = slog.New(&retries)
	})
	direct := open(t, srv, bucket, "faulty", nil)
	ctx := t.Context()

	big := randomBytes(1, 23<<20+17)
	if err := b.Put(ctx, "obj/big", bytes.NewReader(big), -1); err != nil {
		t.Fatalf("Put big: %v", err)
	}
	small := []byte("small object")
	if err := b.Put(ctx, "obj/small", bytes.NewReader(small), int64(len(small))); err != nil {
		t.Fatalf("Put small: %v", err)
	}
	if got := mustGetAll(t, direct, "obj/big", 0, -1); !bytes.Equal(got, big) {
		t.Fatal("big object differs")
	}
	for range 3 { // long enough for a truncated body to be resumed
		if got := mustGetAll(t, b, "obj/big", 0, -1); !bytes.Equal(got, big) {
			t.Fatal("big object read through faults differs")
		}
		if got := mustGetAll(t, b, "obj/big", 1<<20+3, 5<<20); !bytes.Equal(got, big[1<<20+3:6<<20+3]) {
			t.Fatal("range read through faults differs")
		}
	}
	for range 3 {
		if info, err := b.Stat(ctx, "obj/small"); err != nil || info.Size != int64(len(small)) {
			t.Fatalf("Stat = %+v, %v", info, err)
		}
		var names []string
		if err := b.List(ctx, "obj/", func(oi storage.ObjectInfo) error { names = append(names, oi.Name); return nil }); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(names) != "[obj/big obj/small]" {
			t.Fatalf("List = %q", names)
		}
		var dirs []string
		if err := b.ListDirs(ctx, "", func(seg string) error { dirs = append(dirs, seg); return nil }); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(dirs) != "[obj]" {
			t.Fatalf("ListDirs = %q", dirs)
		}
	}
	if err := b.PutIfAbsent(ctx, "commit", []byte("mine")); err != nil {
		t.Fatalf("PutIfAbsent: %v", err)
	}
	if err := b.PutIfAbsent(ctx, "commit", []byte("theirs")); !errors.Is(err, storage.ErrExists) {
		t.Fatalf("second PutIfAbsent = %v, want ErrExists", err)
	}
	if err := b.Delete(ctx, "obj/small"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := direct.Stat(ctx, "obj/small"); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("Stat after Delete = %v", err)
	}
	for _, f := range []fault{slowDown, internal, reset, truncate} {
		if proxy.count(f) == 0 {
			t.Errorf("fault %d never injected", f)
		}
	}
	if retries.n.Load() == 0 {
		t.Error("no retries logged")
	}
	srv.CheckNoUploads(t, bucket)
}

// TestLostResponses: a PutIfAbsent or a multipart completion whose answer
// is lost is retried, and the retry recognises its own success.
func TestLostResponses(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	var drop atomic.Value // func(*http.Request) bool
	drop.Store(func(*http.Request) bool { return false })
	var once sync.Once
	proxy := newFaultProxy(t, srv.Endpoint(), func(r *http.Request, n int) fault {
		f := pass
		if drop.Load().(func(*http.Request) bool)(r) {
			once.Do(func() { f = dropResponse })
		}
		return f
	})
	b := open(t, srv, bucket, "", func(c *s3.Config) {
		c.Endpoint = proxy.URL
		c.Retry = s3.RetryPolicy{Initial: time.Millisecond, Deadline: 30 * time.Second}
	})
	ctx := t.Context()

	drop.Store(func(r *http.Request) bool { return r.Method == http.MethodPut && r.Header.Get("If-None-Match") == "*" })
	if err := b.PutIfAbsent(ctx, "commit", []byte("record")); err != nil {
		t.Fatalf("PutIfAbsent with its answer lost: %v", err)
	}
	if proxy.count(dropResponse) != 1 {
		t.Fatal("the answer was not dropped")
	}
	if err := b.PutIfAbsent(ctx, "commit", []byte("record")); !errors.Is(err, storage.ErrExists) {
		t.Fatalf("PutIfAbsent again = %v, want ErrExists", err)
	}

	once = sync.Once{}
	drop.Store(func(r *http.Request) bool { return r.Method == http.MethodPost && r.URL.Query().Has("uploadId") })
	data := randomBytes(2, 12<<20)
	if err := b.Put(ctx, "big", bytes.NewReader(data), -1); err != nil {
		t.Fatalf("Put with the completion's answer lost: %v", err)
	}
	if proxy.count(dropResponse) != 2 {
		t.Fatal("the completion's answer was not dropped")
	}
	if got := mustGetAll(t, b, "big", 0, -1); !bytes.Equal(got, data) {
		t.Fatal("object differs")
	}
	srv.CheckNoUploads(t, bucket)
}

// gatedReader yields data, stopping once at gate bytes until released.
type gatedReader struct {
	data    []byte
	off     int
	gate    int
	passed  bool // the reader's own; the channels are the test's view
	reached chan struct{}
	release chan struct{}
}

func newGatedReader(data []byte, gate int) *gatedReader {
	return &gatedReader{data: data, gate: gate, reached: make(chan struct{}), release: make(chan struct{})}
}

func (g *gatedReader) Read(p []byte) (int, error) {
	if g.off == g.gate && !g.passed {
		g.passed = true
		close(g.reached)
		<-g.release
	}
	if g.off == len(g.data) {
		return 0, io.EOF
	}
	end := len(g.data)
	if g.off < g.gate {
		end = g.gate
	}
	n := copy(p, g.data[g.off:end])
	g.off += n
	return n, nil
}

// TestFreezeDuringPut: MinIO stops answering (SIGSTOP) midway through a
// multipart upload; the stalled requests are cancelled and retried, and
// the Put completes once MinIO resumes.
func TestFreezeDuringPut(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	var retries retryCounter
	b := open(t, srv, bucket, "", func(c *s3.Config) {
		c.StallTimeout = 500 * time.Millisecond
		c.Retry = s3.RetryPolicy{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond, Deadline: time.Minute}
		c.Logger = slog.New(&retries)
	})
	data := randomBytes(3, 60<<20)
	r := newGatedReader(data, 20<<20)
	done := make(chan error, 1)
	go func() { done <- b.Put(t.Context(), "frozen", r, int64(len(data))) }()
	<-r.reached
	srv.Freeze()
	close(r.release)
	time.Sleep(3 * time.Second)
	srv.Thaw()
	if err := <-done; err != nil {
		t.Fatalf("Put across a frozen server: %v\n%s", err, srv.Logs())
	}
	if retries.n.Load() == 0 {
		t.Error("no request stalled and was retried")
	}
	if got := mustGetAll(t, b, "frozen", 0, -1); !bytes.Equal(got, data) {
		t.Fatal("object differs")
	}
	srv.CheckNoUploads(t, bucket)
}

// TestRestartDuringPut: MinIO is killed midway through a multipart upload
// and restarted; the Put rides it out.
func TestRestartDuringPut(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "", func(c *s3.Config) {
		c.Retry = s3.RetryPolicy{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond, Deadline: time.Minute}
	})
	data := randomBytes(4, 40<<20)
	r := newGatedReader(data, 15<<20)
	done := make(chan error, 1)
	go func() { done <- b.Put(t.Context(), "restarted", r, -1) }()
	<-r.reached
	srv.Kill()
	close(r.release)
	time.Sleep(time.Second)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Put across a restart: %v", err)
	}
	if got := mustGetAll(t, b, "restarted", 0, -1); !bytes.Equal(got, data) {
		t.Fatal("object differs")
	}
	srv.CheckNoUploads(t, bucket)
}

// TestFreezeDuringGet: a Get whose body stalls reopens the rest of its
// range once MinIO answers again.
func TestFreezeDuringGet(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "", func(c *s3.Config) {
		c.StallTimeout = 500 * time.Millisecond
		c.Retry = s3.RetryPolicy{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond, Deadline: time.Minute}
	})
	data := randomBytes(5, 96<<20)
	if err := b.Put(t.Context(), "obj", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	rc, err := b.Get(t.Context(), "obj", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	head := make([]byte, 1<<20)
	if _, err := io.ReadFull(rc, head); err != nil {
		t.Fatal(err)
	}
	srv.Freeze()
	go func() { time.Sleep(2 * time.Second); srv.Thaw() }()
	rest, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("reading across a freeze: %v", err)
	}
	if !bytes.Equal(append(head, rest...), data) {
		t.Fatal("object read across a freeze differs")
	}
}

// TestPartsInMemory: a Put of unknown size holds at most PartConcurrency
// part buffers.
func TestPartsInMemory(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "", func(c *s3.Config) { c.PartConcurrency = 3 })
	data := randomBytes(6, 64<<20)
	if err := b.Put(t.Context(), "obj", bytes.NewReader(data), -1); err != nil {
		t.Fatal(err)
	}
	if peak := b.PeakBuffers(); peak > 3 || peak < 2 {
		t.Errorf("peak part buffers = %d, want 2..3", peak)
	}
	if n := b.BuffersInUse(); n != 0 {
		t.Errorf("%d part buffers not returned", n)
	}
	if got := mustGetAll(t, b, "obj", 0, -1); !bytes.Equal(got, data) {
		t.Fatal("object differs")
	}
}

// TestPermanentErrors: wrong or missing credentials and a missing bucket
// fail at once, with messages naming the bucket and the endpoint, and
// never the secret.
func TestPermanentErrors(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	const wrongSecret = "not-the-secret-0123456789"
	tests := []struct {
		name    string
		bucket  string
		creds   *credentials.Credentials
		want    error
		wantMsg string
	}{
		{"wrong-secret", bucket, credentials.NewStaticV4(srv.AccessKey, wrongSecret, ""), s3.ErrAccessDenied, "SignatureDoesNotMatch"},
		{"unknown-key", bucket, credentials.NewStaticV4("nobody", wrongSecret, ""), s3.ErrAccessDenied, "InvalidAccessKeyId"},
		{"anonymous", bucket, credentials.NewStaticV4("", "", ""), s3.ErrAccessDenied, "no credentials were found"},
		{"missing-bucket", "no-such-bucket", srv.Credentials(), s3.ErrNoSuchBucket, "does not exist"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			_, err := s3.New(t.Context(), s3.Config{Bucket: tt.bucket, Endpoint: srv.Endpoint(), Region: miniotest.Region, Credentials: tt.creds})
			if !errors.Is(err, tt.want) {
				t.Fatalf("New = %v, want %v", err, tt.want)
			}
			t.Log(err)
			msg := err.Error()
			for _, want := range []string{tt.bucket, srv.Endpoint(), tt.wantMsg} {
				if !strings.Contains(msg, want) {
					t.Errorf("error %q does not contain %q", msg, want)
				}
			}
			if strings.Contains(msg, wrongSecret) || strings.Contains(msg, srv.SecretKey) {
				t.Errorf("error %q reveals a secret", msg)
			}
			if el := time.Since(start); el > testtime.Scale(15*time.Second) { // the retry deadline is minutes
				t.Errorf("permanent error took %v", el)
			}
		})
	}

	// A bucket removed under an open backend.
	gone := srv.NewBucket(t)
	b := open(t, srv, gone, "", nil)
	if err := srv.Client().RemoveBucket(t.Context(), gone); err != nil {
		t.Fatal(err)
	}
	err := b.Put(t.Context(), "x", bytes.NewReader([]byte("x")), 1)
	if !errors.Is(err, s3.ErrNoSuchBucket) || !strings.Contains(err.Error(), gone) {
		t.Fatalf("Put into a removed bucket = %v", err)
	}
	err = b.List(t.Context(), "", func(storage.ObjectInfo) error { return nil })
	if !errors.Is(err, s3.ErrNoSuchBucket) {
		t.Fatalf("List of a removed bucket = %v", err)
	}
}

func TestS3Names(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "p", nil)
	ctx := t.Context()
	for _, name := range []string{"bad/\xff\xfe", "a/" + strings.Repeat("s/", 600) + "x"} {
		if err := b.Put(ctx, name, bytes.NewReader(nil), 0); !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("Put(%.20q) = %v, want ErrInvalidName", name, err)
		}
		if err := b.PutIfAbsent(ctx, name, nil); !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("PutIfAbsent(%.20q) = %v, want ErrInvalidName", name, err)
		}
	}
	if err := b.List(ctx, "\xff", func(storage.ObjectInfo) error { return nil }); !errors.Is(err, storage.ErrInvalidName) {
		t.Errorf("List(invalid UTF-8) = %v, want ErrInvalidName", err)
	}
	// Keys that are not valid names, written by other tools, are skipped.
	for _, key := range []string{"p/dir/", "p/ok"} {
		if _, err := srv.Client().PutObject(ctx, bucket, key, bytes.NewReader(nil), 0, minioPutOpts()); err != nil {
			t.Fatal(err)
		}
	}
	var names []string
	if err := b.List(ctx, "", func(oi storage.ObjectInfo) error { names = append(names, oi.Name); return nil }); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(names) != "[ok]" {
		t.Errorf("List = %q, want [ok]", names)
	}
}

// TestListDirsResumes: a directory listing that spans pages and fails on
// the second page resumes after the last directory it gave, without
// repeating or losing one.
func TestListDirsResumes(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	failed := false
	proxy := newFaultProxy(t, srv.Endpoint(), func(r *http.Request, n int) fault {
		if r.URL.Query().Get("continuation-token") != "" && !failed {
			failed = true
			return internal
		}
		return pass
	})
	direct := open(t, srv, bucket, "p", nil)
	b := open(t, srv, bucket, "p", func(c *s3.Config) {
		c.Endpoint = proxy.URL
		c.Retry = s3.RetryPolicy{Initial: time.Millisecond, Deadline: 30 * time.Second}
	})
	const n = 1100 // more than one page of 1000
	var want []string
	g, ctx := errgroup.WithContext(t.Context())
	g.SetLimit(16)
	for i := range n {
		seg := fmt.Sprintf("%05d", i)
		want = append(want, seg)
		g.Go(func() error {
			return direct.Put(ctx, "d/"+seg+"/x", bytes.NewReader([]byte("x")), 1)
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	var got []string
	if err := b.ListDirs(t.Context(), "d/", func(seg string) error { got = append(got, seg); return nil }); err != nil {
		t.Fatal(err)
	}
	if !failed {
		t.Fatal("the second page never failed; the test proves nothing")
	}
	if !slices.Equal(got, want) {
		t.Fatalf("ListDirs gave %d directories (first %q), want %d", len(got), got[:min(3, len(got))], n)
	}
}
