// Package miniotest runs a real MinIO server for tests and benchmarks: on
// 127.0.0.1 with a free port, a temporary data directory and fresh random
// root credentials passed to it through its environment. The binary is the
// one scripts/minio.sh installs (go install github.com/minio/minio@<pin>);
// it is looked up as $MINIO_BIN, then in GOBIN or GOPATH/bin, then on PATH.
//
// Start skips the test when MinIO is not installed, except under CI (the
// CI environment variable set), where a missing server is a failure: CI
// must not pass by skipping what it is meant to check.
//
// A Server can be frozen (SIGSTOP), thawed, killed and restarted on the
// same port and data, to test how clients ride out outages.
package miniotest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Region is the region MinIO reports.
const Region = "us-east-1"

// ErrNotInstalled: no MinIO binary was found.
var ErrNotInstalled = errors.New("minio is not installed (run scripts/minio.sh)")

// Server is a running (or stopped) MinIO process.
type Server struct {
	AccessKey, SecretKey string

	bin, dir, addr, consoleAddr string

	mu     sync.Mutex
	log    bytes.Buffer
	cmd    *exec.Cmd
	exited chan struct{}
	client *minio.Client
}

// Start launches a server for the test and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("MinIO is required under CI: %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	s, err := Launch(bin, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

var binary = sync.OnceValues(findBinary)

// Binary returns the path of the MinIO binary, or ErrNotInstalled.
func Binary() (string, error) { return binary() }

func findBinary() (string, error) {
	if p := os.Getenv("MINIO_BIN"); p != "" {
		return p, nil
	}
	var dirs []string
	if out, err := exec.Command("go", "env", "GOBIN", "GOPATH").Output(); err == nil {
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		if len(lines) > 0 && lines[0] != "" {
			dirs = append(dirs, lines[0])
		}
		if len(lines) > 1 {
			for _, gp := range filepath.SplitList(lines[1]) {
				dirs = append(dirs, filepath.Join(gp, "bin"))
			}
		}
	}
	for _, d := range dirs {
		p := filepath.Join(d, "minio")
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	if p, err := exec.LookPath("minio"); err == nil {
		return p, nil
	}
	return "", ErrNotInstalled
}

// Launch starts MinIO from bin on data directory dir, with new random
// credentials, and waits until it serves requests.
func Launch(bin, dir string) (*Server, error) {
	s := &Server{bin: bin, dir: dir, AccessKey: "ckptd-" + randHex(6), SecretKey: randHex(20)}
	var err error
	for range 3 { // a free port can be taken before MinIO binds it
		if s.addr, err = freeAddr(); err != nil {
			return nil, err
		}
		if s.consoleAddr, err = freeAddr(); err != nil {
			return nil, err
		}
		if err = s.start(); err == nil {
			return s, nil
		}
	}
	return nil, err
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// start runs the process and waits for it to be ready.
func (s *Server) start() error {
	cmd := exec.Command(s.bin, "server", "--quiet", "--address", s.addr, "--console-address", s.consoleAddr, s.dir)
	cmd.Env = append(environWithout("MINIO_", "AWS_"),
		"MINIO_ROOT_USER="+s.AccessKey, "MINIO_ROOT_PASSWORD="+s.SecretKey,
		"MINIO_BROWSER=off", "MINIO_UPDATE=off", "MINIO_CI_CD=1")
	w := &lockedWriter{s: s}
	cmd.Stdout, cmd.Stderr = w, w
	// Its own process group, so a Ctrl-C meant for the tests does not
	// race our cleanup, and signals reach only MinIO; SIGKILL when the
	// test binary dies (a timeout's panic), so no server outlives the run.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start minio: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()
	if err := s.waitReady(60 * time.Second); err != nil {
		s.Kill()
		return err
	}
	return nil
}

func environWithout(prefixes ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		keep := true
		for _, p := range prefixes {
			if strings.HasPrefix(kv, p) {
				keep = false
			}
		}
		if keep {
			env = append(env, kv)
		}
	}
	return env
}

type lockedWriter struct{ s *Server }

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	return w.s.log.Write(p)
}

// waitReady polls until an authenticated request succeeds: MinIO answers
// 503 while it initialises.
func (s *Server) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return fmt.Errorf("minio exited at start:\n%s", s.Logs())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err = s.Client().ListBuckets(ctx)
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("minio not ready after %v: %v\n%s", timeout, err, s.Logs())
}

// Endpoint returns the server's URL, http://127.0.0.1:port.
func (s *Server) Endpoint() string { return "http://" + s.addr }

// Addr returns host:port.
func (s *Server) Addr() string { return s.addr }

// Credentials returns the root credentials.
func (s *Server) Credentials() *credentials.Credentials {
	return credentials.NewStaticV4(s.AccessKey, s.SecretKey, "")
}

// Env returns the environment a client process needs to reach the server
// with the root credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
// AWS_SECRET_ACCESS_KEY and AWS_REGION.
func (s *Server) Env() []string {
	return []string{
		"AWS_ENDPOINT_URL=" + s.Endpoint(),
		"AWS_ACCESS_KEY_ID=" + s.AccessKey,
		"AWS_SECRET_ACCESS_KEY=" + s.SecretKey,
		"AWS_REGION=" + Region,
	}
}

// Client returns a minio-go client with the root credentials, for setting
// up and inspecting the server independently of the code under test.
func (s *Server) Client() *minio.Client {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.ResponseHeaderTimeout = 30 * time.Second
		c, err := minio.New(s.addr, &minio.Options{Creds: s.Credentials(), Region: Region, Transport: tr})
		if err != nil {
			panic(err) // only for a malformed address, which freeAddr never makes
		}
		s.client = c
	}
	return s.client
}

// CreateBucket creates a bucket.
func (s *Server) CreateBucket(ctx context.Context, name string) error {
	return s.Client().MakeBucket(ctx, name, minio.MakeBucketOptions{Region: Region})
}

var bucketSeq struct {
	sync.Mutex
	n int
}

// NewBucket creates a bucket with a fresh name and returns the name.
func (s *Server) NewBucket(t testing.TB) string {
	t.Helper()
	bucketSeq.Lock()
	bucketSeq.n++
	name := fmt.Sprintf("test-%d-%s", bucketSeq.n, randHex(3))
	bucketSeq.Unlock()
	if err := s.CreateBucket(t.Context(), name); err != nil {
		t.Fatalf("create bucket %s: %v", name, err)
	}
	return name
}

// IncompleteUploads lists the multipart uploads in progress under prefix,
// as "key (upload id)".
func (s *Server) IncompleteUploads(ctx context.Context, bucket, prefix string) ([]string, error) {
	var out []string
	for u := range s.Client().ListIncompleteUploads(ctx, bucket, prefix, true) {
		if u.Err != nil {
			return out, u.Err
		}
		out = append(out, fmt.Sprintf("%s (%s)", u.Key, u.UploadID))
	}
	return out, nil
}

// Freeze stops the process (SIGSTOP): connections stay open but nothing
// answers, like a hung server or a black-holed network.
func (s *Server) Freeze() { s.signal(syscall.SIGSTOP) }

// Thaw resumes a frozen server (SIGCONT).
func (s *Server) Thaw() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd != nil && cmd.Process != nil {
		_ = cmd.Process.Signal(sig)
	}
}

// Kill kills the process (SIGKILL, as a crash would) and waits for it.
func (s *Server) Kill() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-exited
}

// Restart starts a killed server again on the same port and data.
func (s *Server) Restart() error {
	s.Kill()
	return s.start()
}

// Close kills the server; its data directory belongs to the caller.
func (s *Server) Close() {
	s.Thaw()
	s.Kill()
}

// Logs returns what the server printed.
func (s *Server) Logs() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log.String()
}

// CheckNoUploads fails t if multipart uploads are left in bucket: every
// failed or cancelled upload must have been aborted.
func (s *Server) CheckNoUploads(t testing.TB, bucket string) {
	t.Helper()
	left, err := s.IncompleteUploads(context.Background(), bucket, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("multipart uploads left behind: %q", left)
	}
}
