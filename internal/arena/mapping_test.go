package arena

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"testing"
)

func TestMapSharesBytesWithDaemon(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		a := mustOpen(t, Options{Dir: dir, Size: 4 * mib})
		m, err := Map(a.Path(), a.Size())
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if int64(len(m.Bytes())) != a.Size() {
			t.Fatalf("client maps %d bytes", len(m.Bytes()))
		}
		r, err := a.Alloc(context.Background(), 3*mib)
		if err != nil {
			t.Fatal(err)
		}
		client := m.Bytes()[r.Offset : r.Offset+r.Length]
		daemon := a.Bytes()[r.Offset : r.Offset+r.Length]

		copy(client, bytes.Repeat([]byte("from the trainer "), 1000))
		if !bytes.Equal(daemon, client) {
			t.Fatal("daemon does not see the client's copy")
		}
		copy(daemon[r.Length-5:], "drain")
		if string(client[r.Length-5:]) != "drain" {
			t.Fatal("client does not see the daemon's write")
		}

		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if err := m.Close(); err != nil || m.Bytes() != nil {
			t.Fatalf("second Close = %v, Bytes %d", err, len(m.Bytes()))
		}
	})
}

func TestMapRejects(t *testing.T) {
	a := mustOpen(t, Options{Dir: filepath.Join(t.TempDir(), "a"), Size: mib})
	tests := []struct {
		name string
		path string
		size int64
	}{
		{"wrong size", a.Path(), 2 * mib},
		{"zero size", a.Path(), 0},
		{"missing file", filepath.Join(t.TempDir(), "nope"), mib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if m, err := Map(tt.path, tt.size); err == nil {
				m.Close()
				t.Fatal("Map succeeded")
			}
		})
	}
	if _, err := Map(a.Path(), 0); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("Map with size 0 = %v", err)
	}
}
