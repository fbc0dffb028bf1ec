package memstore_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/memstore"
	"github.com/ckptd/ckptd/storage/storagetest"
)

func TestConformance(t *testing.T) {
	storagetest.Run(t, func(*testing.T) storage.Backend { return memstore.New() })
}

// TestS3Names: like S3, and unlike a file system, a name may be an object
// and the prefix of others.
func TestS3Names(t *testing.T) {
	b := memstore.New()
	ctx := t.Context()
	for _, name := range []string{"a", "a/b"} {
		if err := b.Put(ctx, name, bytes.NewReader([]byte(name)), int64(len(name))); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"a", "a/b"} {
		rc, err := b.Get(ctx, name, 0, -1)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(rc)
		if string(got) != name {
			t.Errorf("%s holds %q", name, got)
		}
	}
}

// TestGetKeepsVersion: a reader keeps the version it opened.
func TestGetKeepsVersion(t *testing.T) {
	b := memstore.New()
	ctx := t.Context()
	if err := b.Put(ctx, "x", bytes.NewReader([]byte("old")), 3); err != nil {
		t.Fatal(err)
	}
	rc, err := b.Get(ctx, "x", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Put(ctx, "x", bytes.NewReader([]byte("new!")), 4); err != nil {
		t.Fatal(err)
	}
	if got, _ := io.ReadAll(rc); string(got) != "old" {
		t.Errorf("reader opened before the Put read %q", got)
	}
}

func TestClosed(t *testing.T) {
	b := memstore.New()
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Put(t.Context(), "x", bytes.NewReader(nil), 0); !errors.Is(err, memstore.ErrClosed) {
		t.Errorf("Put after Close = %v, want ErrClosed", err)
	}
	if _, err := b.Stat(t.Context(), "x"); !errors.Is(err, memstore.ErrClosed) {
		t.Errorf("Stat after Close = %v, want ErrClosed", err)
	}
	if err := b.List(t.Context(), "", func(storage.ObjectInfo) error { return nil }); !errors.Is(err, memstore.ErrClosed) {
		t.Errorf("List after Close = %v, want ErrClosed", err)
	}
}
