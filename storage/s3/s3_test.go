package s3_test

import (
	"bytes"
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

// A writer killed mid-Put leaves its multipart upload: ListTemporaries
// shows it under the object's name, with the bytes of its parts and the
// time of the newest, only below the backend's prefix (MinIO lists
// uploads only by exact key or for the whole bucket), and DeleteTemporary
// aborts it.
func TestLeftoverUploads(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	b := open(t, srv, bucket, "team/ckpt", nil)
	core := minio.Core{Client: srv.Client()}
	ctx := t.Context()
	start := func(key string, parts int) string {
		t.Helper()
		id, err := core.NewMultipartUpload(ctx, bucket, key, minio.PutObjectOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for n := 1; n <= parts; n++ {
			data := make([]byte, s3.MinPartSize)
			if _, err := core.PutObjectPart(ctx, bucket, key, id, n, bytes.NewReader(data), int64(len(data)), minio.PutObjectPartOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		return id
	}
	mine := start("team/ckpt/job/steps/000000000001/a/rank-00000.data", 2)
	start("team/ckpt/job/steps/000000000002/b/rank-00003.data", 0)
	start("team/other/job/steps/000000000001/a/rank-00000.data", 1) // another prefix's
	start("team/ckpt-x/job", 0)                                     // a key the prefix's string begins, not below it
	got := map[string]storage.Temporary{}
	err := b.ListTemporaries(ctx, "job/steps/", func(tmp storage.Temporary) error {
		got[tmp.Name] = tmp
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("ListTemporaries(job/steps/) = %+v, want this prefix's two uploads", got)
	}
	one := got["job/steps/000000000001/a/rank-00000.data"]
	if one.ID != mine || one.Size != 2*s3.MinPartSize || time.Since(one.ModTime).Abs() > time.Hour {
		t.Errorf("upload with two parts = %+v, want id %s and %d bytes", one, mine, 2*s3.MinPartSize)
	}
	if tmp := got["job/steps/000000000002/b/rank-00003.data"]; tmp.Size != 0 || tmp.ModTime.IsZero() {
		t.Errorf("upload without parts = %+v", tmp)
	}
	n := 0
	_ = b.ListTemporaries(ctx, "job/steps/000000000002/", func(storage.Temporary) error { n++; return nil })
	if n != 1 {
		t.Errorf("ListTemporaries(job/steps/000000000002/) listed %d, want 1", n)
	}
	for range 2 {
		if err := b.DeleteTemporary(ctx, one); err != nil {
			t.Fatal(err)
		}
	}
	left, err := srv.IncompleteUploads(ctx, bucket, "team/ckpt/job/steps/000000000001/a/rank-00000.data")
	if err != nil || len(left) != 0 {
		t.Fatalf("after DeleteTemporary: uploads %v, %v", left, err)
	}
	if err := b.DeleteTemporary(ctx, storage.Temporary{Name: "job/x", ID: "a/b"}); !errors.Is(err, storage.ErrInvalidName) {
		t.Errorf("DeleteTemporary with an id holding a slash = %v, want ErrInvalidName", err)
	}
}
