package storagetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/storage"
)

// randomBytes returns n bytes determined by seed.
func randomBytes(seed uint64, n int) []byte {
	var key [32]byte
	key[0], key[1] = byte(seed), byte(seed>>8)
	b := make([]byte, n)
	_, _ = rand.NewChaCha8(key).Read(b)
	return b
}

// chunkyReader yields its data in reads of varying, odd sizes, and hides
// bytes.Reader's WriterTo so backends see a plain stream.
type chunkyReader struct {
	data []byte
	i    int
}

func newChunkyReader(data []byte) *chunkyReader { return &chunkyReader{data: data} }

func (r *chunkyReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	r.i++
	n := min(len(p), len(r.data), 1+(r.i*7919)%(300<<10))
	copy(p, r.data[:n])
	r.data = r.data[n:]
	return n, nil
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

func mustPut(t *testing.T, b storage.Backend, name string, data []byte) {
	t.Helper()
	if err := b.Put(t.Context(), name, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatalf("Put %s: %v", name, err)
	}
}

func mustDelete(t *testing.T, b storage.Backend, name string) {
	t.Helper()
	if err := b.Delete(t.Context(), name); err != nil {
		t.Fatalf("Delete %s: %v", name, err)
	}
}

func mustGet(t *testing.T, b storage.Backend, name string, offset, length int64) []byte {
	t.Helper()
	data, err := get(t.Context(), b, name, offset, length)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// get reads a range of an object; it is safe to call from any goroutine.
func get(ctx context.Context, b storage.Backend, name string, offset, length int64) ([]byte, error) {
	rc, err := b.Get(ctx, name, offset, length)
	if err != nil {
		return nil, fmt.Errorf("Get(%s, %d, %d): %w", name, offset, length, err)
	}
	data, err := io.ReadAll(rc)
	if cerr := rc.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("reading Get(%s, %d, %d): %w", name, offset, length, err)
	}
	return data, nil
}

// checkObject checks the object's contents and size.
func checkObject(t *testing.T, b storage.Backend, name string, want []byte) {
	t.Helper()
	if got := mustGet(t, b, name, 0, -1); !bytes.Equal(got, want) {
		t.Fatalf("%s holds %d bytes, not the %d put", name, len(got), len(want))
	}
	info, err := b.Stat(t.Context(), name)
	if err != nil {
		t.Fatalf("Stat %s: %v", name, err)
	}
	if info.Name != name || info.Size != int64(len(want)) {
		t.Fatalf("Stat %s = %+v, want size %d", name, info, len(want))
	}
}

// checkMissing checks that Stat and Get report ErrNotFound, naming the
// object.
func checkMissing(t *testing.T, b storage.Backend, name string) {
	t.Helper()
	_, err := b.Stat(t.Context(), name)
	if !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("Stat(%q) = %v, want ErrNotFound", name, err)
	}
	if !strings.Contains(err.Error(), name) {
		t.Errorf("Stat error %q does not name the object", err)
	}
	rc, err := b.Get(t.Context(), name, 0, -1)
	if err == nil {
		rc.Close()
	}
	if !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("Get(%q) = %v, want ErrNotFound", name, err)
	}
}

func listNames(t *testing.T, b storage.Backend, prefix string) []string {
	t.Helper()
	var names []string
	err := b.List(t.Context(), prefix, func(info storage.ObjectInfo) error {
		names = append(names, info.Name)
		return nil
	})
	if err != nil {
		t.Fatalf("List(%q): %v", prefix, err)
	}
	return names
}

func checkList(t *testing.T, b storage.Backend, prefix string, want []string) {
	t.Helper()
	if got := listNames(t, b, prefix); !slices.Equal(got, want) {
		t.Fatalf("List(%q) = %q, want %q", prefix, got, want)
	}
}

func listDirs(t *testing.T, b storage.Backend, dir string) []string {
	t.Helper()
	var segs []string
	err := b.ListDirs(t.Context(), dir, func(seg string) error {
		segs = append(segs, seg)
		return nil
	})
	if err != nil {
		t.Fatalf("ListDirs(%q): %v", dir, err)
	}
	return segs
}

func listTemporaries(t *testing.T, b storage.Backend, prefix string) []storage.Temporary {
	t.Helper()
	var temps []storage.Temporary
	err := b.ListTemporaries(t.Context(), prefix, func(tmp storage.Temporary) error {
		temps = append(temps, tmp)
		return nil
	})
	if err != nil {
		t.Fatalf("ListTemporaries(%q): %v", prefix, err)
	}
	return temps
}

// checkNoTemporaries checks that nothing of a Put is left in the store:
// every Put before returned, whether it succeeded or failed.
func checkNoTemporaries(t *testing.T, b storage.Backend) {
	t.Helper()
	if got := listTemporaries(t, b, ""); len(got) != 0 {
		t.Fatalf("temporaries left after every Put returned: %+v", got)
	}
}
