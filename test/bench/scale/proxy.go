package main

// The counting proxy: every S3 request of the daemons and of the ckptd
// commands goes through it on its way to MinIO, so the counts are the
// store's view (each LIST page, each multipart part, each 404 counts), not
// what ckptd believes it asked for. It can also act as a throttled S3:
// past a rate per prefix it answers 503 SlowDown without forwarding, as
// S3 does past about 3,500 writes or 5,500 reads per second per prefix.

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Request kinds, as the table shows them.
const (
	kindPut    = "PUT"
	kindGet    = "GET"
	kindHead   = "HEAD"
	kindList   = "LIST"
	kindPost   = "POST"
	kindDelete = "DEL"
	kindOther  = "other"
)

var kinds = []string{kindPut, kindGet, kindHead, kindList, kindPost, kindDelete}

// What an object request was about, from the key's last segment.
const (
	objCommit   = "commit"
	objManifest = "manifest"
	objData     = "data"
	objOther    = "other"
)

// counts is a snapshot of the proxy's counters: by kind, by
// "kind:object", and "503" for the requests it refused as throttled.
type counts map[string]int64

func (c counts) sub(o counts) counts {
	out := counts{}
	for k, v := range c {
		if d := v - o[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

func (c counts) total() int64 {
	var n int64
	for _, k := range append(kinds, kindOther) {
		n += c[k]
	}
	return n
}

// stepTimes is when, in the store's view, a step's last manifest was
// written and its commit record created.
type stepTimes struct {
	lastManifest, commit time.Time
}

type proxy struct {
	bucket string
	rp     *httputil.ReverseProxy
	srv    *http.Server
	addr   string

	mu      sync.Mutex
	counts  counts
	steps   map[string]*stepTimes // by "<job>/<step segment>"
	limiter *limiter              // nil: no throttling
}

func startProxy(target, bucket string) (*proxy, error) {
	u, err := url.Parse(target)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{bucket: bucket, counts: counts{}, steps: map[string]*stepTimes{}, addr: ln.Addr().String()}
	// The Host header stays the proxy's: it is what the client signed.
	p.rp = httputil.NewSingleHostReverseProxy(u)
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 256
	p.rp.Transport = tr
	p.rp.ErrorHandler = p.proxyError
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: time.Minute}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

func (p *proxy) endpoint() string { return "http://" + p.addr }

func (p *proxy) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = p.srv.Shutdown(ctx)
}

func (p *proxy) snapshot() counts {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(counts, len(p.counts))
	for k, v := range p.counts {
		out[k] = v
	}
	return out
}

// times returns what the proxy saw of job's step.
func (p *proxy) times(job string, step int64) stepTimes {
	p.mu.Lock()
	defer p.mu.Unlock()
	if st := p.steps[fmt.Sprintf("%s/%012d", job, step)]; st != nil {
		return *st
	}
	return stepTimes{}
}

// throttle makes the proxy refuse requests past rate per second per
// prefix (0: never).
func (p *proxy) throttle(rate float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.limiter = nil
	if rate > 0 {
		p.limiter = newLimiter(rate)
	}
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	kind, key := p.classify(r)
	p.mu.Lock()
	p.counts[kind]++
	if key != "" {
		p.counts[kind+":"+objectKind(key)]++
	}
	lim := p.limiter
	p.mu.Unlock()
	if lim != nil && !lim.allow(throttlePrefix(key), time.Now()) {
		p.mu.Lock()
		p.counts["503"]++
		p.mu.Unlock()
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><Resource>%s</Resource></Error>`, r.URL.Path)
		return
	}
	rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
	p.rp.ServeHTTP(rec, r)
	if r.Method == http.MethodPut && rec.status == http.StatusOK && r.URL.Query().Get("partNumber") == "" {
		p.noteWrite(key, time.Now())
	}
}

// proxyError answers a request MinIO did not answer, or whose client
// went away, and counts it ("gone: <kind>:<object>" when the client gave
// up, "error: ..." otherwise) instead of logging a line each.
func (p *proxy) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	kind, key := p.classify(r)
	what := "error: "
	if r.Context().Err() != nil {
		what = "gone: "
	}
	p.mu.Lock()
	p.counts[what+kind+":"+objectKind(key)]++
	p.mu.Unlock()
	w.WriteHeader(http.StatusBadGateway)
}

// noteWrite records the time of a completed object write, for the
// manifests' and commit records' times.
func (p *proxy) noteWrite(key string, now time.Time) {
	kind := objectKind(key)
	if kind != objCommit && kind != objManifest {
		return
	}
	i := strings.Index(key, "/steps/")
	if i < 0 {
		return
	}
	job := key[:i]
	if j := strings.LastIndexByte(job, '/'); j >= 0 {
		job = job[j+1:]
	}
	seg, _, _ := strings.Cut(key[i+len("/steps/"):], "/")
	id := job + "/" + seg
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.steps[id]
	if st == nil {
		st = &stepTimes{}
		p.steps[id] = st
	}
	if kind == objCommit {
		st.commit = now
	} else if now.After(st.lastManifest) {
		st.lastManifest = now
	}
}

// classify names a request's kind and the object key it is about ("" for
// a bucket-level request). Multipart uploads are PUTs of parts between a
// POST that starts and one that completes them.
func (p *proxy) classify(r *http.Request) (string, string) {
	path := strings.TrimPrefix(r.URL.Path, "/")
	bucketLevel := path == p.bucket || path == p.bucket+"/"
	key := ""
	if !bucketLevel {
		key = strings.TrimPrefix(path, p.bucket+"/")
	}
	q := r.URL.Query()
	switch r.Method {
	case http.MethodGet:
		switch {
		case !bucketLevel:
			return kindGet, key
		case q.Has("location"):
			return kindOther, ""
		default: // ListObjectsV2, ListMultipartUploads: a page each, throttled as its prefix
			return kindList, q.Get("prefix")
		}
	case http.MethodPut:
		return kindPut, key
	case http.MethodHead:
		return kindHead, key
	case http.MethodPost:
		return kindPost, key
	case http.MethodDelete:
		return kindDelete, key
	}
	return kindOther, key
}

func objectKind(key string) string {
	switch {
	case strings.HasSuffix(key, "/COMMIT.json"):
		return objCommit
	case strings.HasSuffix(key, ".manifest.json"):
		return objManifest
	case strings.HasSuffix(key, ".data"):
		return objData
	}
	return objOther
}

// throttlePrefix is the prefix whose rate a request counts against: the
// key's folder, where S3 would start a partition if load stayed there.
func throttlePrefix(key string) string {
	if i := strings.LastIndexByte(key, '/'); i >= 0 {
		return key[:i+1]
	}
	return ""
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// limiter is a token bucket per prefix: rate tokens a second, as many in
// the bucket at most.
type limiter struct {
	rate    float64
	mu      sync.Mutex
	buckets map[string]*tokens
}

type tokens struct {
	n    float64
	last time.Time
}

func newLimiter(rate float64) *limiter {
	return &limiter{rate: rate, buckets: map[string]*tokens{}}
}

func (l *limiter) allow(prefix string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[prefix]
	if b == nil {
		b = &tokens{n: l.rate, last: now}
		l.buckets[prefix] = b
	}
	b.n = min(l.rate, b.n+now.Sub(b.last).Seconds()*l.rate)
	b.last = now
	if b.n < 1 {
		return false
	}
	b.n--
	return true
}
