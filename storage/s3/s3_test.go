package s3_test

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
	"github.com/ckptd/ckptd/storage/storagetest"
)

// open returns a backend on the server's bucket under prefix, with
// config changes from mod.
func open(t *testing.T, srv *miniotest.Server, bucket, prefix string, mod func(*s3.Config)) *s3.Backend {
	t.Helper()
	cfg := s3.Config{
		Bucket: bucket, Prefix: prefix, Endpoint: srv.Endpoint(), Region: miniotest.Region,
		Credentials: srv.Credentials(),
		PartSize:    s3.MinPartSize, // many parts from the suite's objects
		Retry:       s3.RetryPolicy{Deadline: 30 * time.Second},
	}
	if mod != nil {
		mod(&cfg)
	}
	b, err := s3.New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConformance(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	var n atomic.Int64
	storagetest.Run(t, func(t *testing.T) storage.Backend {
		return open(t, srv, bucket, fmt.Sprintf("suite/%d", n.Add(1)), nil)
	})
	srv.CheckNoUploads(t, bucket)
}

// TestConformanceBucketRoot runs the suite with no prefix, one bucket per
// backend, and the default part size.
func TestConformanceBucketRoot(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	srv := miniotest.Start(t)
	var buckets []string
	storagetest.Run(t, func(t *testing.T) storage.Backend {
		bucket := srv.NewBucket(t)
		buckets = append(buckets, bucket)
		return open(t, srv, bucket, "", func(c *s3.Config) { c.PartSize = 0 })
	})
	for _, b := range buckets {
		srv.CheckNoUploads(t, b)
	}
}

func TestLocation(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "a/b", nil)
	if got, want := b.Location(), "s3://"+bucket+"/a/b"; got != want {
		t.Errorf("Location = %q, want %q", got, want)
	}
	if !strings.HasPrefix(srv.Endpoint(), b.Endpoint()) {
		t.Errorf("Endpoint = %q", b.Endpoint())
	}
}

func minioPutOpts() minio.PutObjectOptions { return minio.PutObjectOptions{} }

// TestUnreachableIsUnavailable: a store that never answers is reported as
// storage.ErrUnavailable once the retry deadline passes, naming the
// endpoint, so that callers can tell an outage from a wrong request.
func TestUnreachableIsUnavailable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	endpoint := "http://" + l.Addr().String()
	l.Close()
	_, err = s3.New(t.Context(), s3.Config{
		Bucket: "bucket", Endpoint: endpoint, Region: "us-east-1",
		Credentials: credentials.NewStaticV4("k", "s", ""),
		Retry:       s3.RetryPolicy{Initial: time.Millisecond, Deadline: 300 * time.Millisecond},
	})
	if !errors.Is(err, storage.ErrUnavailable) || !strings.Contains(err.Error(), endpoint) {
		t.Fatalf("New on a closed port = %v, want ErrUnavailable naming %s", err, endpoint)
	}
}
