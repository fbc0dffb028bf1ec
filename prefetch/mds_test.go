package prefetch

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/klauspost/compress/zstd"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// The datasets under testdata/mds were written by Mosaic streaming's own
// MDSWriter (testdata/mds/make.py says how), one per compression, with
// hashes; expected.json holds every sample's columns as MDS encodes them.
var mdsTestdata = []string{"plain", "zstd", "gz", "bz2", "br", "snappy"}

func testdataBackend(t testing.TB, dir string) storage.Backend {
	t.Helper()
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// epochSamples reads one rank's epoch whole: every sample's fields by key.
func epochSamples(t *testing.T, b storage.Backend, prefix string, c *Cache, spec Spec, opts Options) (map[string]map[string][]byte, []string, Stats, error) {
	t.Helper()
	it, err := Open(context.Background(), b, prefix, c, spec, opts)
	if err != nil {
		return nil, nil, Stats{}, err
	}
	defer it.Close()
	got, order := map[string]map[string][]byte{}, []string(nil)
	for {
		batch, err := it.Next(context.Background())
		if errors.Is(err, io.EOF) {
			return got, order, it.Stats(), nil
		}
		if err != nil {
			return got, order, it.Stats(), err
		}
		for _, s := range batch.Samples {
			if got[s.Key] != nil {
				t.Fatalf("sample %s delivered twice", s.Key)
			}
			fields := map[string][]byte{}
			for _, f := range s.Fields {
				fields[f.Name] = bytes.Clone(f.Data)
			}
			got[s.Key] = fields
			order = append(order, s.Key)
		}
	}
}

func expectedMDS(t *testing.T, dir string) []map[string][]byte {
	t.Helper()
	return expectedFields(t, filepath.Join(dir, "expected.json"))
}

// expectedFields reads a testdata expected.json: samples as {field:
// base64 of its bytes}.
func expectedFields(t *testing.T, path string) []map[string][]byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var raw []map[string]string
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	out := make([]map[string][]byte, len(raw))
	for i, s := range raw {
		out[i] = map[string][]byte{}
		for k, v := range s {
			if out[i][k], err = base64.StdEncoding.DecodeString(v); err != nil {
				t.Fatal(err)
			}
		}
	}
	return out
}

func checkMDS(t *testing.T, what string, got map[string]map[string][]byte, want []map[string][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d samples delivered, want %d", what, len(got), len(want))
	}
	for i, w := range want {
		g := got[strconv.Itoa(i)]
		if len(g) != len(w) {
			t.Fatalf("%s: sample %d has fields %v, want %d", what, i, g, len(w))
		}
		for k, v := range w {
			if !bytes.Equal(g[k], v) {
				t.Fatalf("%s: sample %d column %s = %x, want %x", what, i, k, g[k], v)
			}
		}
	}
}

// Every dataset MDSWriter wrote (each compression, with hashes) is read as
// written: every sample once, every column's bytes, told from its
// index.json without a format named, by any rank count.
func TestMDSWrittenByMosaic(t *testing.T) {
	b := testdataBackend(t, "testdata/mds")
	c := newCache(t, 64<<20)
	for _, name := range mdsTestdata {
		want := expectedMDS(t, filepath.Join("testdata/mds", name))
		for _, f := range []Format{"", MDS} {
			got, _, st, err := epochSamples(t, b, name+"/", c, Spec{Format: f, BatchSize: 3, WorldSize: 1, Seed: 5}, Options{})
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			checkMDS(t, name, got, want)
			if st.CorruptSkipped != 0 {
				t.Fatalf("%s: %d skipped", name, st.CorruptSkipped)
			}
		}
		all := map[string]map[string][]byte{}
		for rank := range 2 {
			got, _, _, err := epochSamples(t, b, name+"/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 2, Seed: 1, Even: EvenOff}, Options{})
			if err != nil {
				t.Fatal(err)
			}
			for k, v := range got {
				if all[k] != nil {
					t.Fatalf("%s: sample %s delivered by both ranks", name, k)
				}
				all[k] = v
			}
		}
		checkMDS(t, name+" at 2 ranks", all, want)
	}
}

// An even epoch of MDS shards takes the counts from index.json: ranks
// deliver as many samples each, reading no shard to count.
func TestMDSEvenFromTheIndex(t *testing.T) {
	b := testdataBackend(t, "testdata/mds")
	c := newCache(t, 64<<20)
	var counts []int
	for rank := range 3 {
		it, err := Open(context.Background(), b, "plain/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 3, Seed: 2, Even: EvenPad}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for {
			batch, err := it.Next(context.Background())
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			n += len(batch.Samples)
		}
		it.Close()
		counts = append(counts, n)
	}
	if counts[0] != counts[1] || counts[1] != counts[2] || counts[0] < 40/3 {
		t.Fatalf("even pad gave ranks %v samples", counts)
	}
}

// mdsShardBytes encodes samples (each a list of column values) as an MDS
// shard of the given columns, as MDSWriter's encode_joint_shard does.
func mdsShardBytes(sizes []int64, samples [][][]byte) []byte {
	var body [][]byte
	for _, s := range samples {
		var head, data []byte
		for c, v := range s {
			if sizes[c] < 0 {
				head = binary.LittleEndian.AppendUint32(head, uint32(len(v)))
			}
			data = append(data, v...)
		}
		body = append(body, append(head, data...))
	}
	config := []byte(`{"version":2}`)
	n := uint32(len(body))
	out := binary.LittleEndian.AppendUint32(nil, n)
	at := uint32(4 + 4*(len(body)+1) + len(config))
	for _, s := range body {
		out = binary.LittleEndian.AppendUint32(out, at)
		at += uint32(len(s))
	}
	out = binary.LittleEndian.AppendUint32(out, at)
	out = append(out, config...)
	for _, s := range body {
		out = append(out, s...)
	}
	return out
}

// writeMDS writes an MDS dataset of shards×per samples of two columns
// ("n": 8 bytes, "text": payload bytes) into dir, zstd-compressed or not,
// with sha1 hashes of the stored files; it returns the samples.
func writeMDS(t testing.TB, dir string, shards, per, payload int, compress bool) [][][]byte {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sizes := []int64{8, -1}
	var all [][][]byte
	var entries []map[string]any
	for s := range shards {
		var samples [][][]byte
		for range per {
			k := len(all)
			text := bytes.Repeat([]byte(fmt.Sprintf("<%d>", k)), payload+1)[:payload]
			samples = append(samples, [][]byte{binary.LittleEndian.AppendUint64(nil, uint64(k)), text})
			all = append(all, samples[len(samples)-1])
		}
		raw := mdsShardBytes(sizes, samples)
		rawName := fmt.Sprintf("shard.%05d.mds", s)
		entry := map[string]any{
			"format": "mds", "version": 2, "column_names": []string{"n", "text"}, "column_encodings": []string{"int", "bytes"},
			"column_sizes": []any{8, nil}, "samples": per, "hashes": []string{"sha1"},
			"raw_data": map[string]any{"basename": rawName, "bytes": len(raw), "hashes": map[string]string{"sha1": sha1Hex(raw)}},
		}
		stored, name := raw, rawName
		if compress {
			enc, err := zstd.NewWriter(nil)
			if err != nil {
				t.Fatal(err)
			}
			stored, name = enc.EncodeAll(raw, nil), rawName+".zstd"
			entry["compression"] = "zstd:3"
			entry["zip_data"] = map[string]any{"basename": name, "bytes": len(stored), "hashes": map[string]string{"sha1": sha1Hex(stored)}}
		}
		writeFile(t, filepath.Join(dir, name), stored)
		entries = append(entries, entry)
	}
	idx, err := json.Marshal(map[string]any{"version": 2, "shards": entries})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "index.json"), idx)
	return all
}

func sha1Hex(b []byte) string {
	h := mdsHashes["sha1"]()
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil))
}

// Shards larger than the read-ahead budget lets a shard be are parsed as
// they are read (and decompressed), and deliver what those read whole do.
func TestMDSStreamedShards(t *testing.T) {
	for _, compress := range []bool{false, true} {
		dir := t.TempDir()
		want := writeMDS(t, filepath.Join(dir, "d"), 3, 40, 20<<10, compress) // 800 KiB shards
		b := testdataBackend(t, dir)
		got, _, st, err := epochSamples(t, b, "d/", newCache(t, 64<<20), Spec{BatchSize: 8, WorldSize: 1, ShuffleWindow: 1}, Options{ReadAheadBytes: 1 << 20})
		if err != nil {
			t.Fatalf("compress %v: %v", compress, err)
		}
		if st.CacheHits+st.CacheMisses != 3 || len(got) != len(want) {
			t.Fatalf("compress %v: %d samples, stats %+v", compress, len(got), st)
		}
		for i, w := range want {
			g := got[strconv.Itoa(i)]
			if !bytes.Equal(g["n"], w[0]) || !bytes.Equal(g["text"], w[1]) {
				t.Fatalf("compress %v: sample %d differs", compress, i)
			}
		}
	}
}

// A shard whose bytes differ from its hash fails the epoch naming it, or
// is skipped with skip_corrupt: read whole, before any of its samples;
// streamed, once read (its samples before were delivered, as a damaged
// tar's are).
func TestMDSHashMismatch(t *testing.T) {
	for _, budget := range []int64{0, 1 << 20} { // read whole; streamed
		dir := t.TempDir()
		writeMDS(t, filepath.Join(dir, "d"), 2, 40, 20<<10, false)
		p := filepath.Join(dir, "d", "shard.00001.mds")
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		data[len(data)-5] ^= 0xff // a byte of the last sample's text
		writeFile(t, p, data)
		b := testdataBackend(t, dir)
		spec := Spec{BatchSize: 8, WorldSize: 1, ShuffleWindow: 1}
		_, _, _, err = epochSamples(t, b, "d/", newCache(t, 64<<20), spec, Options{ReadAheadBytes: budget})
		var se *ShardError
		if !errors.As(err, &se) || se.Shard != "d/shard.00001.mds" {
			t.Fatalf("budget %d: %v, want the shard named corrupt", budget, err)
		}
		spec.SkipCorrupt = true
		got, _, st, err := epochSamples(t, b, "d/", newCache(t, 64<<20), spec, Options{ReadAheadBytes: budget})
		if err != nil || st.CorruptSkipped != 1 {
			t.Fatalf("budget %d, skip_corrupt: %v, %d skipped", budget, err, st.CorruptSkipped)
		}
		// Streamed, the damage is found as the last sample ends: it is
		// dropped, the 39 before it were delivered.
		if budget == 0 && len(got) != 40 || budget != 0 && len(got) != 79 {
			t.Fatalf("budget %d: %d samples delivered", budget, len(got))
		}
	}
}

// An index that cannot be read as a dataset fails the open, saying why.
func TestMDSBadIndex(t *testing.T) {
	dir := t.TempDir()
	writeMDS(t, filepath.Join(dir, "d"), 2, 3, 10, false)
	b := testdataBackend(t, dir)
	good, err := os.ReadFile(filepath.Join(dir, "d", "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	var idx map[string]any
	if err := json.Unmarshal(good, &idx); err != nil {
		t.Fatal(err)
	}
	shard := func(f func(map[string]any)) []byte {
		var m map[string]any
		_ = json.Unmarshal(good, &m)
		f(m["shards"].([]any)[1].(map[string]any))
		out, _ := json.Marshal(m)
		return out
	}
	for _, tc := range []struct {
		index []byte
		want  string
	}{
		{[]byte(`{"version": 1, "shards": []}`), "version 1"},
		{[]byte(`[1, 2]`), "not an MDS index"},
		{[]byte(`{"version": 2, "shards": []}`), "no shards"},
		{[]byte(`{"chunks": [{"filename": "chunk-0-0.bin"}], "config": {}}`), "litdata's index"},
		{shard(func(s map[string]any) { s["format"] = "json" }), `format "json"`},
		{shard(func(s map[string]any) { s["raw_data"].(map[string]any)["basename"] = "../d/shard.00000.mds" }), "not a plain path"},
		{shard(func(s map[string]any) { s["raw_data"].(map[string]any)["basename"] = "shard.00009.mds" }), "which is not there"},
		{shard(func(s map[string]any) { s["raw_data"].(map[string]any)["basename"] = "shard.00000.mds" }), "listed twice"},
		{shard(func(s map[string]any) { s["samples"] = 1 << 40 }), "samples"},
		{shard(func(s map[string]any) { s["raw_data"].(map[string]any)["bytes"] = 1 << 62 }), "cannot hold"},
		{shard(func(s map[string]any) { s["column_sizes"] = []any{8} }), "column sizes"},
		{shard(func(s map[string]any) { s["column_names"] = []any{"n", "n"} }), "repeated"},
		{shard(func(s map[string]any) { s["compression"] = "lzma" }), `compression "lzma"`},
		{shard(func(s map[string]any) { s["compression"] = "zstd" }), "no zip_data"},
	} {
		writeFile(t, filepath.Join(dir, "d", "index.json"), tc.index)
		_, err := Open(context.Background(), b, "d/", newCache(t, 1<<20), Spec{Format: MDS, BatchSize: 1, WorldSize: 1}, Options{})
		if !errors.Is(err, ErrInvalid) || !bytes.Contains([]byte(err.Error()), []byte(tc.want)) {
			t.Errorf("index %.80s: %v, want ErrInvalid saying %q", tc.index, err, tc.want)
		}
	}
}

// A shard whose header or samples lie about their sizes fails naming it,
// after the samples before the damage.
func TestMDSDamagedShard(t *testing.T) {
	sizes := []int64{8, -1}
	samples := [][][]byte{{make([]byte, 8), []byte("abc")}, {make([]byte, 8), []byte("defg")}, {make([]byte, 8), []byte("h")}}
	good := mdsShardBytes(sizes, samples)
	cols := &mdsColumns{names: []string{"n", "text"}, sizes: sizes, vars: 1}
	m := &mdsShard{raw: int64(len(good)), stored: int64(len(good)), cols: cols}
	walk := func(data []byte, n int) (int, error) {
		br := bytes.NewReader(data)
		seen := 0
		err := walkMDS(br, func() int64 { return int64(len(data) - br.Len()) }, int64(len(data)), m, n,
			func(int) error { seen++; return nil }, func(mdsField) error { return nil })
		return seen, err
	}
	if n, err := walk(good, 3); err != nil || n != 3 {
		t.Fatalf("good shard: %d samples, %v", n, err)
	}
	for _, tc := range []struct {
		what string
		edit func([]byte) []byte
		n    int
		seen int
	}{
		{"count differs from the index", func(b []byte) []byte { return b }, 4, 0},
		{"truncated", func(b []byte) []byte { return b[:len(b)-2] }, 3, 0},
		{"offsets go back", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[8:], 2); return b }, 3, 0},
		{"last offset past the end", func(b []byte) []byte { binary.LittleEndian.PutUint32(b[16:], 1<<31); return b }, 3, 0},
		{"a column size lies", func(b []byte) []byte {
			second := binary.LittleEndian.Uint32(b[8:])
			binary.LittleEndian.PutUint32(b[second:], 1<<30)
			return b
		}, 3, 2},
	} {
		seen, err := walk(tc.edit(bytes.Clone(good)), tc.n)
		if err == nil || seen != tc.seen {
			t.Errorf("%s: %d samples begun, %v; want an error after %d", tc.what, seen, err, tc.seen)
		}
	}
}

// FuzzMDSIndex: any bytes as index.json give shards or an error, never a
// panic, and never more listing than the budget.
func FuzzMDSIndex(f *testing.F) {
	for _, name := range mdsTestdata {
		if data, err := os.ReadFile(filepath.Join("testdata/mds", name, "index.json")); err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte(`{"version":2,"shards":[{"format":"mds","column_names":["a"],"column_sizes":[null],"samples":9223372036854775807,"raw_data":{"basename":"x","bytes":0}}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		shards, err := parseMDSIndex(data, "p/", 1<<20)
		if err != nil {
			return
		}
		for _, sh := range shards {
			u := sh.unit
			if u.samples < 0 || u.samples > maxMDSSamples || u.mds.raw > maxMDSRaw || u.mds.stored <= 0 && u.mds.codec != "" {
				t.Fatalf("accepted %+v", u)
			}
			if err := checkBasename(sh.Name[len("p/"):]); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// FuzzMDSShard: any bytes as a shard of known columns (and as each
// compression's output, claiming any size) are parsed or refused, never a
// panic, and never held beyond what the index says of them.
func FuzzMDSShard(f *testing.F) {
	// The columns of the testdata (MDSWriter's, sorted by name).
	sizes := []int64{-1, 8, 1, -1, 12}
	codecs := []string{"", "zstd", "gz", "bz2", "br", "snappy"}
	f.Add(mdsShardBytes(sizes, [][][]byte{
		{[]byte("x"), make([]byte, 8), {1}, nil, make([]byte, 12)},
		{nil, make([]byte, 8), {2}, []byte("yz"), make([]byte, 12)},
	}), uint8(2), uint8(0), uint16(0))
	for _, name := range mdsTestdata {
		dir := filepath.Join("testdata/mds", name)
		idx, err := os.ReadFile(filepath.Join(dir, "index.json"))
		if err != nil {
			f.Fatal(err)
		}
		shards, err := parseMDSIndex(idx, "", 1<<20)
		if err != nil {
			f.Fatal(err)
		}
		m := shards[0].unit.mds
		data, err := os.ReadFile(filepath.Join(dir, shards[0].Name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, uint8(shards[0].unit.samples), uint8(slices.Index(codecs, m.codec)), uint16(m.raw))
	}
	f.Fuzz(func(t *testing.T, data []byte, n, codec uint8, claim uint16) {
		cols := &mdsColumns{names: []string{"blob", "id", "label", "text", "vec"}, sizes: sizes, vars: 2}
		raw := data
		if c := codecs[int(codec)%len(codecs)]; c != "" {
			out, err := decompressMDS(c, data, int64(claim))
			if err != nil {
				return
			}
			if len(out) != int(claim) {
				t.Fatalf("%s: %d bytes, claimed %d", c, len(out), claim)
			}
			raw = out
		}
		m := &mdsShard{raw: int64(len(raw)), stored: int64(len(raw)), cols: cols}
		br := bytes.NewReader(raw)
		_ = walkMDS(br, func() int64 { return int64(len(raw) - br.Len()) }, int64(len(raw)), m, int(n),
			func(int) error { return nil },
			func(f mdsField) error {
				if f.start < 0 || f.size < 0 || f.start+f.size > int64(len(raw)) {
					t.Fatalf("field %+v beyond a shard of %d bytes", f, len(raw))
				}
				return nil
			})
	})
}
