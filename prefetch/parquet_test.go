package prefetch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The files under testdata/parquet were written by pyarrow
// (testdata/parquet/make.py says how): the same 30 rows in row groups of
// 7, one file per compression and page version; expected.json holds each
// row as the fields ckptd delivers.
var pqTestdata = []string{"brotli-v2", "gzip-plain", "lz4-crc", "none", "snappy-v1", "zstd-v2"}

func expectedPQ(t *testing.T) []map[string][]byte {
	t.Helper()
	return expectedFields(t, "testdata/parquet/expected.json")
}

func checkPQ(t *testing.T, got map[string]map[string][]byte, want []map[string][]byte) {
	t.Helper()
	if len(got) != len(pqTestdata)*len(want) {
		t.Fatalf("%d rows delivered, want %d", len(got), len(pqTestdata)*len(want))
	}
	for _, file := range pqTestdata {
		for i, w := range want {
			key := file + "/" + itoa(i)
			g, ok := got[key]
			if !ok {
				t.Fatalf("row %s not delivered", key)
			}
			if len(g) != len(w) {
				t.Fatalf("row %s: fields %v, want %v", key, fieldNames(g), fieldNames(w))
			}
			for k, v := range w {
				if !bytes.Equal(g[k], v) {
					t.Fatalf("row %s field %s = %x, want %x", key, k, g[k], v)
				}
			}
		}
	}
}

func itoa(i int) string { b, _ := json.Marshal(i); return string(b) }

func fieldNames(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// Every file pyarrow wrote (each compression, page v1 and v2, with and
// without dictionaries, with page CRCs) is read as written: every row
// once, every column's bytes, told from the .parquet files without a
// format named, a row group a shard dealt among ranks.
func TestParquetWrittenByPyarrow(t *testing.T) {
	b := testdataBackend(t, "testdata")
	c := newCache(t, 64<<20)
	want := expectedPQ(t)
	for _, f := range []Format{"", Parquet} {
		got, _, st, err := epochSamples(t, b, "parquet/", c, Spec{Format: f, BatchSize: 5, WorldSize: 1, Seed: 3}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		checkPQ(t, got, want)
		if st.Shards != len(pqTestdata)*5 { // 30 rows in row groups of 7
			t.Fatalf("%d shards, want a row group each", st.Shards)
		}
	}
	all := map[string]map[string][]byte{}
	for rank := range 3 {
		got, _, _, err := epochSamples(t, b, "parquet/", c, Spec{BatchSize: 4, Rank: rank, WorldSize: 3, Seed: 9, Even: EvenOff}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range got {
			if all[k] != nil {
				t.Fatalf("row %s delivered twice", k)
			}
			all[k] = v
		}
	}
	checkPQ(t, all, want)
}

// A row group whose bytes are damaged fails the epoch naming it, or is
// skipped with skip_corrupt; a file whose footer is not one fails the
// open.
func TestParquetDamaged(t *testing.T) {
	dir := t.TempDir()
	good, err := os.ReadFile("testdata/parquet/lz4-crc.parquet")
	if err != nil {
		t.Fatal(err)
	}
	f, err := parsePQFooter(good[len(good)-8-int(le32(good[len(good)-8:])):len(good)-8], int64(len(good)))
	if err != nil {
		t.Fatal(err)
	}
	s, _, _, err := pqRange(f, 1)
	if err != nil {
		t.Fatal(err)
	}
	bad := bytes.Clone(good)
	bad[s+40] ^= 0xff // inside row group 1's first column chunk, under a CRC
	writeFile(t, filepath.Join(dir, "d", "x.parquet"), bad)
	b := testdataBackend(t, dir)
	spec := Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1}
	_, _, _, err = epochSamples(t, b, "d/", newCache(t, 64<<20), spec, Options{})
	var se *ShardError
	if !errors.As(err, &se) || se.Shard != "d/x.parquet#1" {
		t.Fatalf("%v, want row group 1 named corrupt", err)
	}
	spec.SkipCorrupt = true
	got, _, st, err := epochSamples(t, b, "d/", newCache(t, 64<<20), spec, Options{})
	if err != nil || st.CorruptSkipped != 1 || len(got) != 30-7 {
		t.Fatalf("skip_corrupt: %v, %d skipped, %d rows", err, st.CorruptSkipped, len(got))
	}

	for _, tc := range []struct {
		what string
		edit func([]byte) []byte
	}{
		{"no magic", func(b []byte) []byte { return append(b[:len(b)-4:len(b)-4], "XXXX"...) }},
		{"a footer longer than the file", func(b []byte) []byte { putLE32(b[len(b)-8:], 1<<31); return b }},
		{"a footer cut", func(b []byte) []byte { putLE32(b[len(b)-8:], 20); return b }},
	} {
		writeFile(t, filepath.Join(dir, "d", "x.parquet"), tc.edit(bytes.Clone(good)))
		_, err := Open(context.Background(), b, "d/", newCache(t, 1<<20), Spec{Format: Parquet, BatchSize: 1, WorldSize: 1}, Options{})
		if !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", tc.what, err)
		}
	}
}

func le32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func putLE32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}

// pqSeeds are the footers and row groups of the pyarrow files.
func pqSeeds(t testing.TB) (footers [][]byte, files []*pqFile, groups [][]byte) {
	for _, name := range pqTestdata {
		data, err := os.ReadFile(filepath.Join("testdata/parquet", name+".parquet"))
		if err != nil {
			t.Fatal(err)
		}
		n := int(le32(data[len(data)-8:]))
		footer := data[len(data)-8-n : len(data)-8]
		f, err := parsePQFooter(footer, int64(len(data)))
		if err != nil {
			t.Fatal(err)
		}
		footers, files = append(footers, footer), append(files, f)
		s, e, _, err := pqRange(f, 0)
		if err != nil {
			t.Fatal(err)
		}
		groups = append(groups, data[s:e])
	}
	return footers, files, groups
}

// FuzzPQFooter: any bytes as a footer decode within the bound skimThrift
// sets, or are refused; never a panic.
func FuzzPQFooter(f *testing.F) {
	footers, _, _ := pqSeeds(f)
	for _, ft := range footers {
		f.Add(ft)
	}
	f.Fuzz(func(t *testing.T, footer []byte) {
		pf, err := parsePQFooter(footer, 1<<20)
		if err != nil {
			return
		}
		for i := range pf.md.RowGroups {
			_, _, _, _ = pqRange(pf, i)
		}
	})
}

// FuzzPQRowGroup: any bytes as row group 0 of a pyarrow file's footer are
// rewritten within the row group's claimed size and read, or refused;
// never a panic, nor more memory than the claim.
func FuzzPQRowGroup(f *testing.F) {
	_, files, groups := pqSeeds(f)
	for i, g := range groups {
		f.Add(uint8(i), g)
	}
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		pf := files[int(which)%len(files)]
		start, _, mem, err := pqRange(pf, 0)
		if err != nil {
			t.Fatal(err)
		}
		out, err := rewritePQ(&pqRowGroup{file: pf, index: 0}, start, data, mem)
		if err != nil {
			return
		}
		if int64(len(out)) > mem {
			t.Fatalf("rewritten to %d bytes, more than the %d claimed", len(out), mem)
		}
		rows := int(pf.md.RowGroups[0].NumRows)
		err = readPQRows(out, rows, len(pf.names), func(int, [][]byte, []bool) error { return nil })
		if err != nil && strings.Contains(err.Error(), "fnPanic") {
			t.Fatal(err)
		}
	})
}
