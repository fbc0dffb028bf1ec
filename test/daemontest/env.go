package daemontest

import (
	"archive/tar"
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ckptd/ckptd/internal/miniotest"
)

// S3Store starts MinIO with a fresh bucket and returns the server, the
// bucket and a storage URL in it.
func S3Store(t *testing.T) (*miniotest.Server, string, string) {
	t.Helper()
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	return srv, bucket, "s3://" + bucket + "/ckpt"
}

// WithoutEndpoint is env less AWS_ENDPOINT_URL.
func WithoutEndpoint(env []string) []string {
	var out []string
	for _, kv := range env {
		if !strings.HasPrefix(kv, "AWS_ENDPOINT_URL=") {
			out = append(out, kv)
		}
	}
	return out
}

// ClosedAddr returns a 127.0.0.1 address nothing listens on (to refuse
// connections, or for a server to take later). Its port is below the
// kernel's ephemeral range: a port from inside it (what listening on :0
// gives) can be taken meanwhile by any outgoing connection on the
// machine, which made a sidecar started seconds later fail with "address
// already in use" while other suites ran beside it.
func ClosedAddr(t *testing.T) string {
	t.Helper()
	lo, hi := 10000, ephemeralStart()
	for range 1000 {
		if hi <= lo {
			break
		}
		port := lo + rand.IntN(hi-lo)
		if !portsGiven.take(port) {
			continue
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			return addr
		}
	}
	t.Fatal("no free port below the ephemeral range")
	return ""
}

// portsGiven are the ports ClosedAddr gave in this process.
var portsGiven = &portSet{given: map[int]bool{}}

type portSet struct {
	mu    sync.Mutex
	given map[int]bool
}

// take marks port given unless it was, and says whether it did.
func (s *portSet) take(port int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.given[port] {
		return false
	}
	s.given[port] = true
	return true
}

// ephemeralStart is the first port of the kernel's ephemeral range.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		var start int
		if _, err := fmt.Sscan(string(b), &start); err == nil {
			return start
		}
	}
	return 32768
}

// WriteShards writes n WebDataset shards of per samples ("cls" and "txt")
// into dir and returns every sample's txt content by key.
func WriteShards(t *testing.T, dir string, n, per int) map[string]string {
	t.Helper()
	want := map[string]string{}
	for s := range n {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for i := range per {
			key := fmt.Sprintf("s%02d/%04d", s, i)
			txt := strings.Repeat(key+" ", 50+i)
			want[key] = txt
			for _, f := range [][2]string{{"cls", fmt.Sprint(i % 7)}, {"txt", txt}} {
				_ = tw.WriteHeader(&tar.Header{Name: key + "." + f[0], Mode: 0o644, Size: int64(len(f[1]))})
				_, _ = tw.Write([]byte(f[1]))
			}
		}
		_ = tw.Close()
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("train-%03d.tar", s)), buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return want
}
