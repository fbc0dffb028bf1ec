package daemontest

import (
	"archive/tar"
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
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
// connections, or for a server to take).
func ClosedAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
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
