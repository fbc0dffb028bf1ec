package storageurl

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
		{url: "s3://bucket/prefix", errHas: "S3 storage is not available in this build yet"},
		{url: "S3://bucket", errHas: "S3 storage is not available"},
		{url: "s3:bucket", errHas: "S3 storage is not available"},
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
