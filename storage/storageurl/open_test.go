package storageurl

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/ckptd/ckptd/internal/miniotest"
)

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	tests := []struct {
		url      string
		location string // "" when Open must fail
		errHas   string
	}{
		{url: filepath.Join(dir, "plain"), location: "file://" + dir + "/plain"},
		{url: "rel/dir", location: "file://" + dir + "/rel/dir"},
		{url: "./dot", location: "file://" + dir + "/dot"},
		{url: "odd:name", location: "file://" + dir + "/odd:name"},
		{url: "with space#hash", location: "file://" + dir + "/with%20space%23hash"},
		{url: "file://" + dir + "/url", location: "file://" + dir + "/url"},
		{url: "FILE://" + dir + "/upper", location: "file://" + dir + "/upper"},
		{url: "file://localhost" + dir + "/host", location: "file://" + dir + "/host"},
		{url: "file://" + dir + "/esc%20aped", location: "file://" + dir + "/esc%20aped"},

		{url: "", errHas: "empty"},
		{url: "file://relative/path", errHas: "three slashes"},
		{url: "file:relative", errHas: "absolute path"},
		{url: "file://" + dir + "/x?q=1", errHas: "only a path"},
		{url: "file://" + dir + "/x#frag", errHas: "only a path"},
		{url: "file://", errHas: "absolute path"},
		{url: "s3:bucket", errHas: "want s3://bucket"},
		{url: "s3://", errHas: "want s3://bucket"},
		{url: "s3:///prefix", errHas: "want s3://bucket"},
		{url: "s3://bucket/p?versionId=1", errHas: "only a bucket and a prefix"},
		{url: "s3://bucket/p#frag", errHas: "only a bucket and a prefix"},
		{url: "s3://Not_A_Bucket/p", errHas: "bucket name"},
		{url: "s3://bucket/a//b", errHas: "prefix"},
		{url: "s3://bucket/a/../b", errHas: "prefix"},
		{url: "gs://bucket", errHas: `unsupported scheme "gs"`},
		{url: "http://host/x", errHas: `unsupported scheme "http"`},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			b, err := Open(t.Context(), tt.url, OpenOptions{})
			if tt.errHas != "" {
				if err == nil {
					b.Close()
					t.Fatalf("Open(%q) succeeded, want an error containing %q", tt.url, tt.errHas)
				}
				if !strings.Contains(err.Error(), tt.errHas) {
					t.Fatalf("Open(%q) = %v, want an error containing %q", tt.url, err, tt.errHas)
				}
				return
			}
			if err != nil {
				t.Fatalf("Open(%q): %v", tt.url, err)
			}
			defer b.Close()
			if got := b.Location(); got != tt.location {
				t.Errorf("Location() = %q, want %q", got, tt.location)
			}
		})
	}
}

// TestOpenFileSingleSlash: "file:/abs" is a legal file URL for /abs.
func TestOpenFileSingleSlash(t *testing.T) {
	dir := t.TempDir()
	b, err := Open(t.Context(), "file:"+dir+"/one", OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if _, err := os.Stat(filepath.Join(dir, "one")); err != nil {
		t.Fatal(err)
	}
}

func TestOpenCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := Open(ctx, t.TempDir(), OpenOptions{}); err == nil {
		t.Fatal("Open with a cancelled context succeeded")
	}
}

// TestOpenS3 opens s3:// URLs on a real MinIO, with the endpoint from the
// options or the environment and credentials from the environment.
func TestOpenS3(t *testing.T) {
	srv := miniotest.Start(t)
	bucket := srv.NewBucket(t)
	for _, kv := range srv.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	b, err := Open(t.Context(), "s3://"+bucket+"/pre/fix/", OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if got, want := b.Location(), "s3://"+bucket+"/pre/fix"; got != want {
		t.Errorf("Location() = %q, want %q", got, want)
	}
	if err := b.PutIfAbsent(t.Context(), "x", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Client().StatObject(t.Context(), bucket, "pre/fix/x", minio.StatObjectOptions{}); err != nil {
		t.Errorf("object not under the URL's prefix: %v", err)
	}

	t.Setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1") // the option wins
	b2, err := Open(t.Context(), "s3://"+bucket, OpenOptions{S3Endpoint: srv.Endpoint(), S3Region: miniotest.Region})
	if err != nil {
		t.Fatal(err)
	}
	b2.Close()
	_, err = Open(t.Context(), "s3://missing-bucket/p", OpenOptions{S3Endpoint: srv.Endpoint()})
	if err == nil || !strings.Contains(err.Error(), `bucket "missing-bucket" does not exist`) {
		t.Fatalf("Open of a missing bucket = %v", err)
	}
	_, err = Open(t.Context(), "s3://key:s3cr3t@"+bucket, OpenOptions{S3Endpoint: srv.Endpoint()})
	if err == nil || strings.Contains(err.Error(), "s3cr3t") {
		t.Fatalf("Open of a URL with credentials = %v", err)
	}
}
