package checkpoint

import (
	"context"
	"errors"
	"strings"
	"testing"
)

func validManifest(t testing.TB) []byte {
	t.Helper()
	b, _ := newBackendTB(t)
	w, _ := NewWriter(b, WriterOptions{ChunkSize: 64 << 10})
	m, err := w.WriteShard(context.Background(), testShard(1, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	data, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestManifestRoundTrip(t *testing.T) {
	data := validManifest(t)
	m, err := ParseManifest(data)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := m.Encode()
	if string(again) != string(data) {
		t.Fatal("encode(parse(x)) != x")
	}
}

func TestManifestRejects(t *testing.T) {
	good := string(validManifest(t))
	for _, tc := range []struct {
		name, old, new, want string
	}{
		{"future version", `"version": 2`, `"version": 3`, "version 3 is not supported"},
		{"version 1 with an attempt", `"version": 2`, `"version": 1`, "version 1 has no attempt"},
		{"no attempt", `"attempt": "run-1",`, ``, "names no attempt"},
		{"bad attempt", `"attempt": "run-1"`, `"attempt": "../x"`, "attempt"},
		{"huge offset", `"offset": 0,
   "stored"`, `"offset": 9223372036854775807,
   "stored"`, "out of range"},
		{"other format", `"ckptd.manifest"`, `"other"`, "format"},
		{"escaping object", `"object": "steps/000000000001/run-1/rank-00000.data"`, `"object": "steps/../../etc/passwd"`, "invalid object name"},
		{"bad codec", `"codec": "zstd"`, `"codec": "brotli"`, "brotli"},
		{"bad hash", `"hash": "xxh3:`, `"hash": "md5:`, "hash"},
		{"data size", `"data_size": `, `"data_size": 1`, "data_size"},
		{"unknown field", `"job":`, `"jobb": 1, "job":`, "unknown field"},
		{"not json", `{`, `[`, "JSON"},
		{"bad job", `"job": "job"`, `"job": "a/b"`, "contains"},
	} {
		bad := strings.Replace(good, tc.old, tc.new, 1)
		if bad == good {
			t.Fatalf("%s: replacement %q not found", tc.name, tc.old)
		}
		_, err := ParseManifest([]byte(bad))
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrCorrupt containing %q", tc.name, err, tc.want)
		}
	}
}

func FuzzParseManifest(f *testing.F) {
	f.Add(validManifest(f))
	f.Add([]byte(`{"format":"ckptd.manifest","version":1}`))
	f.Add([]byte(`{"format":"ckptd.manifest","version":2,"attempt":"a","job":"j","world_size":1,"tensors":[{"name":"a","dtype":"U8","shape":[4611686018427387904],"offset":0,"length":4611686018427387904}],"chunks":[{"object":"steps/x","offset":9223372036854775000,"raw":4,"stored":4000,"codec":"none","hash":"xxh3:0000000000000000"}],"data_size":4,"stored_size":4}`))
	f.Add([]byte(`{"format":"ckptd.manifest","version":1,"job":"j","world_size":1,"tensors":[{"name":"a","dtype":"F32","shape":[1],"offset":0,"length":4}],"chunks":[{"object":"steps/x","raw":4,"stored":4,"codec":"none","hash":"xxh3:0000000000000000"}],"data_size":4,"stored_size":4}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := ParseManifest(data)
		if err != nil {
			return
		}
		// Whatever parses must be internally consistent: chunks tile the
		// data, and re-encoding parses again.
		var raw int64
		for _, c := range m.Chunks {
			raw += c.Raw
		}
		if raw != m.DataSize {
			t.Fatalf("accepted manifest whose chunks cover %d of %d bytes", raw, m.DataSize)
		}
		again, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParseManifest(again); err != nil {
			t.Fatalf("re-encoded manifest rejected: %v", err)
		}
	})
}
