package prefetch

import (
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"context"
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/sha3"
	"crypto/sha512"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"math"
	"path"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/andybalholm/brotli"
	"github.com/cespare/xxhash/v2"
	"github.com/klauspost/compress/snappy"
	"github.com/klauspost/compress/zstd"
	"github.com/zeebo/xxh3"
	"golang.org/x/crypto/blake2b"
	"golang.org/x/crypto/blake2s"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

// Mosaic streaming's MDS format, read as it is:
//
//   - index.json, at the dataset's root: {"version": 2, "shards": [...]},
//     one entry per shard file, in order, each with its columns
//     (column_names, column_encodings, column_sizes: null for a
//     variable-size column), its sample count, its file (raw_data:
//     basename, bytes, hashes) and, when compressed ("compression":
//     "zstd:7"), the file actually stored (zip_data).
//   - a shard (raw_data, after decompression): uint32 n, n+1 uint32
//     offsets of the samples' starts and of the end (absolute, little
//     endian), the writer's config as JSON, then the samples; a sample is
//     a uint32 size per variable-size column, then every column's bytes,
//     in column order.
//
// A sample's fields are its columns' bytes as MDS encodes them (a "str"
// column is UTF-8, "int" 8 bytes little endian, "jpeg" the JPEG file,
// "pkl" a pickle, ...), named by the column; its key is its global index
// in the dataset (what Mosaic indexes samples by).

// mdsIndexName is the index's name in the dataset's folder.
const mdsIndexName = "index.json"

// Bounds on what an index may claim of a shard: sample counts are bounded
// as positions bound them (maxSamplesPerShard), and a raw shard's offsets
// are uint32s.
const (
	maxMDSRaw = math.MaxUint32
	// maxMDSSamples bounds a shard's offset table (4 bytes a sample, held
	// while the shard is read).
	maxMDSSamples = 1 << 22
)

// errNoIndex: the folder has no index.json (Auto then looks further).
var errNoIndex = errors.New("no MDS index.json")

// mdsShard is what index.json says of one shard.
type mdsShard struct {
	codec  string            // the compression's family ("zstd", "gz", "bz2", "br", "snappy"), "" for none
	stored int64             // bytes of the stored file, as the index says
	hashes map[string]string // of the stored file: algorithm → hex digest, those ckptd computes
	raw    int64             // bytes once decompressed
	cols   *mdsColumns
}

// mdsColumns are a shard's columns; shards with the same share one.
type mdsColumns struct {
	names []string
	sizes []int64 // -1: variable
	vars  int     // variable-size columns
}

func (c *mdsColumns) equal(names []string, sizes []int64) bool {
	return slices.Equal(c.names, names) && slices.Equal(c.sizes, sizes)
}

// The index as JSON.
type mdsIndexJSON struct {
	Version int             `json:"version"`
	Shards  []mdsShardJSON  `json:"shards"`
	Chunks  json.RawMessage `json:"chunks"` // litdata's index has these instead
}

type mdsFileJSON struct {
	Basename string            `json:"basename"`
	Bytes    int64             `json:"bytes"`
	Hashes   map[string]string `json:"hashes"`
}

type mdsShardJSON struct {
	Format          string       `json:"format"`
	Version         int          `json:"version"`
	Compression     *string      `json:"compression"`
	ColumnNames     []string     `json:"column_names"`
	ColumnEncodings []string     `json:"column_encodings"`
	ColumnSizes     []*int64     `json:"column_sizes"`
	Samples         int64        `json:"samples"`
	RawData         mdsFileJSON  `json:"raw_data"`
	ZipData         *mdsFileJSON `json:"zip_data"`
}

// mdsCodecs are the compressions MDSWriter writes, by family.
var mdsCodecs = map[string]bool{"zstd": true, "gz": true, "bz2": true, "br": true, "snappy": true}

// mdsHashes are the hash algorithms of Mosaic's (hashlib's and xxhash's
// names) that ckptd checks a shard against.
var mdsHashes = map[string]func() hash.Hash{
	"md5": md5.New, "sha1": sha1.New, "sha224": sha256.New224, "sha256": sha256.New,
	"sha384": sha512.New384, "sha512": sha512.New,
	"sha3_224": func() hash.Hash { return sha3.New224() }, "sha3_256": func() hash.Hash { return sha3.New256() },
	"sha3_384": func() hash.Hash { return sha3.New384() }, "sha3_512": func() hash.Hash { return sha3.New512() },
	"blake2b":  func() hash.Hash { h, _ := blake2b.New512(nil); return h },
	"blake2s":  func() hash.Hash { h, _ := blake2s.New256(nil); return h },
	"xxh64":    func() hash.Hash { return xxhash.New() },
	"xxh3_64":  func() hash.Hash { return &xxh3Sum{h: xxh3.New()} },
	"xxh3_128": func() hash.Hash { return &xxh3Sum{h: xxh3.New(), wide: true} },
	"xxh128":   func() hash.Hash { return &xxh3Sum{h: xxh3.New(), wide: true} },
}

// xxh3Sum gives xxh3's digests in xxhash's canonical (big-endian) bytes,
// as Python's xxhash hexdigest prints them.
type xxh3Sum struct {
	h    *xxh3.Hasher
	wide bool
}

func (x *xxh3Sum) Write(p []byte) (int, error) { return x.h.Write(p) }
func (x *xxh3Sum) Reset()                      { x.h.Reset() }
func (x *xxh3Sum) BlockSize() int              { return x.h.BlockSize() }
func (x *xxh3Sum) Size() int {
	if x.wide {
		return 16
	}
	return 8
}

func (x *xxh3Sum) Sum(b []byte) []byte {
	if x.wide {
		s := x.h.Sum128().Bytes()
		return append(b, s[:]...)
	}
	return binary.BigEndian.AppendUint64(b, x.h.Sum64())
}

// listMDS reads the MDS index.json under prefix and lists its shards, in
// the index's order. An index that is not one, or that names a shard the
// folder does not hold, fails the open: it is the dataset's definition.
func listMDS(ctx context.Context, b storage.Backend, prefix string, budget int64) ([]Shard, error) {
	objs, err := listObjects(ctx, b, prefix, budget, func(string) bool { return true })
	if err != nil {
		return nil, err
	}
	byName := make(map[string]Shard, len(objs))
	for _, o := range objs {
		byName[o.Name] = o
	}
	idxName := joinName(prefix, mdsIndexName)
	idx, ok := byName[idxName]
	if !ok {
		return nil, fmt.Errorf("%w: %s has no %s under prefix %q", errNoIndex, b.Location(), mdsIndexName, printable(prefix))
	}
	data, err := readSmall(ctx, b, idxName, idx.Size, budget, "MDS index")
	if err != nil {
		return nil, err
	}
	shards, err := parseMDSIndex(data, prefix, budget)
	if err != nil {
		if errors.Is(err, ErrTooLarge) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: MDS index %s/%s: %w", ErrInvalid, b.Location(), printable(idxName), err)
	}
	for i := range shards {
		o, ok := byName[shards[i].Name]
		if !ok {
			return nil, fmt.Errorf("%w: MDS index %s/%s names shard %s, which is not there",
				ErrInvalid, b.Location(), printable(idxName), printable(shards[i].Name))
		}
		shards[i].Size, shards[i].ModTime = o.Size, o.ModTime
	}
	return shards, nil
}

// parseMDSIndex parses an index.json's bytes (untrusted: every count and
// size it claims is checked before anything is sized by it) into shards
// named beneath prefix, without their listed sizes.
func parseMDSIndex(data []byte, prefix string, limit int64) ([]Shard, error) {
	var idx mdsIndexJSON
	if err := json.Unmarshal(data, &idx); err != nil {
		return nil, fmt.Errorf("not an MDS index: %w", err)
	}
	if len(idx.Chunks) > 0 && len(idx.Shards) == 0 {
		return nil, errors.New("it is litdata's index (chunks, not shards), whose chunks ckptd does not read: " +
			"convert the dataset to Parquet or tar (docs/datasets.md says why)")
	}
	if idx.Version != 2 {
		return nil, fmt.Errorf("version %d (ckptd reads version 2, what Mosaic streaming writes)", idx.Version)
	}
	if len(idx.Shards) == 0 {
		return nil, errors.New("it lists no shards")
	}
	shards := make([]Shard, 0, len(idx.Shards))
	seen := make(map[string]bool, len(idx.Shards))
	var cols *mdsColumns
	var first, cost int64
	for i, js := range idx.Shards {
		m, name, err := checkMDSShard(js, cols)
		if err != nil {
			return nil, fmt.Errorf("shard %d: %w", i, err)
		}
		cols = m.cols
		name = joinName(prefix, name)
		if seen[name] {
			return nil, fmt.Errorf("shard %d: %s is listed twice", i, printable(name))
		}
		seen[name] = true
		if cost += listCost(name) + mdsCost(m); cost > limit {
			return nil, budget.Wrap(fmt.Errorf("%w: the MDS index lists more shards than the listing budget (%d) allows", ErrTooLarge, limit), budget.DatasetListing)
		}
		u := &unit{samples: int(js.Samples), first: first, mds: m}
		if m.codec != "" {
			u.mem = m.raw
		}
		first += js.Samples
		shards = append(shards, Shard{Name: name, unit: u})
	}
	return shards, nil
}

// mdsCost is what a listed MDS shard holds besides its name.
func mdsCost(m *mdsShard) int64 {
	n := int64(64)
	for k, v := range m.hashes {
		n += int64(len(k)+len(v)) + 48
	}
	return n
}

// checkMDSShard checks one index entry and returns what ckptd keeps of it
// and the name of the file stored. prev is the previous shard's columns,
// shared when equal.
func checkMDSShard(js mdsShardJSON, prev *mdsColumns) (*mdsShard, string, error) {
	if js.Format != "mds" {
		return nil, "", fmt.Errorf("format %q: ckptd reads mds shards (convert the others with Mosaic streaming's MDSWriter)", js.Format)
	}
	n := len(js.ColumnNames)
	switch {
	case n == 0:
		return nil, "", errors.New("no columns")
	case n > maxFields:
		return nil, "", fmt.Errorf("%d columns, more than the %d fields a sample may have", n, maxFields)
	case len(js.ColumnSizes) != n:
		return nil, "", fmt.Errorf("%d column names but %d column sizes", n, len(js.ColumnSizes))
	case len(js.ColumnEncodings) != 0 && len(js.ColumnEncodings) != n:
		return nil, "", fmt.Errorf("%d column names but %d column encodings", n, len(js.ColumnEncodings))
	case js.Samples < 0 || js.Samples > maxMDSSamples:
		return nil, "", fmt.Errorf("%d samples: ckptd reads shards of 0 to %d samples", js.Samples, maxMDSSamples)
	case js.RawData.Bytes < 4*(js.Samples+2) || js.RawData.Bytes > maxMDSRaw:
		return nil, "", fmt.Errorf("raw_data of %d bytes cannot hold %d samples", js.RawData.Bytes, js.Samples)
	}
	names, sizes := js.ColumnNames, make([]int64, n)
	seen := make(map[string]bool, n)
	vars := 0
	for i, name := range names {
		if why := badName("", name); why != "" || name == "" || seen[name] {
			if why == "" {
				why = "it is empty or repeated"
			}
			return nil, "", fmt.Errorf("column %q: %s", name, why)
		}
		seen[name] = true
		switch s := js.ColumnSizes[i]; {
		case s == nil:
			sizes[i] = -1
			vars++
		case *s < 0 || *s > maxMDSRaw:
			return nil, "", fmt.Errorf("column %q: size %d", name, *s)
		default:
			sizes[i] = *s
		}
	}
	m := &mdsShard{raw: js.RawData.Bytes, stored: js.RawData.Bytes}
	if prev != nil && prev.equal(names, sizes) {
		m.cols = prev
	} else {
		m.cols = &mdsColumns{names: slices.Clone(names), sizes: sizes, vars: vars}
	}
	file := js.RawData
	if js.Compression != nil && *js.Compression != "" {
		family, _, _ := strings.Cut(*js.Compression, ":")
		if !mdsCodecs[family] {
			return nil, "", fmt.Errorf("compression %q: ckptd reads zstd, gz, bz2, br and snappy", *js.Compression)
		}
		if js.ZipData == nil {
			return nil, "", fmt.Errorf("compression %q but no zip_data", *js.Compression)
		}
		m.codec, file = family, *js.ZipData
		if file.Bytes <= 0 || file.Bytes > maxMDSRaw {
			return nil, "", fmt.Errorf("zip_data of %d bytes", file.Bytes)
		}
		m.stored = file.Bytes
	}
	if err := checkBasename(file.Basename); err != nil {
		return nil, "", err
	}
	for algo, digest := range file.Hashes {
		if mdsHashes[algo] == nil {
			continue // an algorithm ckptd does not compute (xxh32): not checked
		}
		if m.hashes == nil {
			m.hashes = map[string]string{}
		}
		m.hashes[algo] = strings.ToLower(digest)
	}
	return m, file.Basename, nil
}

// checkBasename refuses a shard file name that is not a plain relative
// path beneath the index's folder.
func checkBasename(b string) error {
	switch {
	case b == "" || !utf8.ValidString(b) || strings.ContainsRune(b, 0):
		return fmt.Errorf("basename %q is not a file name", b)
	case path.IsAbs(b) || path.Clean(b) != b || b == ".." || strings.HasPrefix(b, "../") || b == ".":
		return fmt.Errorf("basename %q is not a plain path beneath the index's folder", b)
	case len(b) > maxKeyBytes:
		return fmt.Errorf("basename of %d bytes", len(b))
	}
	return nil
}

// checkHashes checks data against the digests the index gives.
func checkHashes(want map[string]string, data []byte) error {
	for algo, digest := range want {
		h := mdsHashes[algo]()
		h.Write(data)
		if got := hex.EncodeToString(h.Sum(nil)); got != digest {
			return fmt.Errorf("its %s is %s, index.json says %s", algo, got, digest)
		}
	}
	return nil
}

// decodeMDS checks an MDS shard read whole against its size and hashes and
// decompresses it. Its header and samples are checked as they are parsed.
func decodeMDS(sh Shard, data shardBytes) (shardBytes, error) {
	m := sh.unit.mds
	err := readMapped(func() error {
		if int64(len(data.b)) != m.stored {
			return fmt.Errorf("%d bytes, index.json says %d", len(data.b), m.stored)
		}
		if err := checkHashes(m.hashes, data.b); err != nil {
			return err
		}
		if m.codec == "" {
			return nil
		}
		raw, err := decompressMDS(m.codec, data.b, m.raw)
		if err != nil {
			return err
		}
		data = heapBytes(raw)
		return nil
	})
	if err != nil {
		if errors.Is(err, ErrCorruptShard) {
			return shardBytes{}, err
		}
		return shardBytes{}, corrupt(sh, "%v", err)
	}
	return data, nil
}

// decompressMDS decompresses a whole shard into exactly raw bytes: output
// beyond them is an error, never memory.
func decompressMDS(codec string, src []byte, raw int64) ([]byte, error) {
	if codec == "snappy" {
		n, err := snappy.DecodedLen(src)
		if err != nil {
			return nil, fmt.Errorf("snappy: %w", err)
		}
		if int64(n) != raw {
			return nil, fmt.Errorf("snappy: it decompresses to %d bytes, index.json says %d", n, raw)
		}
		out := make([]byte, n)
		if _, err := snappy.Decode(out, src); err != nil {
			return nil, fmt.Errorf("snappy: %w", err)
		}
		return out, nil
	}
	r, closer, err := mdsDecompressor(codec, bytes.NewReader(src))
	if err != nil {
		return nil, err
	}
	defer closer()
	out := make([]byte, raw)
	if _, err := io.ReadFull(r, out); err != nil {
		return nil, fmt.Errorf("%s: %w (index.json says %d bytes)", codec, err, raw)
	}
	if err := expectEOF(r, codec, raw); err != nil {
		return nil, err
	}
	return out, nil
}

// expectEOF checks a decompressor has nothing after the raw bytes.
func expectEOF(r io.Reader, codec string, raw int64) error {
	var one [1]byte
	n, err := io.ReadFull(r, one[:])
	switch {
	case n > 0:
		return fmt.Errorf("%s: it decompresses to more than the %d bytes index.json says", codec, raw)
	case errors.Is(err, io.EOF):
		return nil
	}
	return fmt.Errorf("%s: %w", codec, err)
}

// mdsMaxWindow bounds a zstd frame's window (the decoder's memory).
const mdsMaxWindow = 64 << 20

// mdsDecompressor streams codec's decompression of r (snappy, a block
// format, cannot be streamed).
func mdsDecompressor(codec string, r io.Reader) (io.Reader, func(), error) {
	switch codec {
	case "zstd":
		d, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true), zstd.WithDecoderMaxWindow(mdsMaxWindow))
		if err != nil {
			return nil, nil, fmt.Errorf("zstd: %w", err)
		}
		return d, d.Close, nil
	case "gz":
		g, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, fmt.Errorf("gz: %w", err)
		}
		return g, func() { g.Close() }, nil
	case "bz2":
		return bzip2.NewReader(r), func() {}, nil
	case "br":
		return brotli.NewReader(r), func() {}, nil
	}
	return nil, nil, fmt.Errorf("compression %q cannot be streamed", codec)
}

// mdsStreams says a shard can be parsed as it is read (all but snappy).
func mdsStreams(m *mdsShard) bool { return m.codec != "snappy" }

// mdsField is one column of a sample: its bytes are size bytes of r from
// start (of the raw shard); the walker passes over what is not read.
type mdsField struct {
	name  string
	start int64
	size  int64
	r     io.Reader
}

// walkMDS parses a raw MDS shard of raw bytes read from r (pos: how many
// have been read), calling sample at each sample's start (with its place
// in the shard) and field for each of its columns. It checks everything
// the shard claims against the index and against itself: sample count,
// offsets within the shard and in order, column sizes adding up to the
// sample. A field the callback does not read is passed over.
func walkMDS(r io.Reader, pos func() int64, raw int64, m *mdsShard, samples int, sample func(i int) error, field func(f mdsField) error) error {
	var word [4]byte
	if _, err := io.ReadFull(r, word[:]); err != nil {
		return fmt.Errorf("header: %w", noEOF(err))
	}
	n := int64(binary.LittleEndian.Uint32(word[:]))
	if n != int64(samples) {
		return fmt.Errorf("it holds %d samples, index.json says %d", n, samples)
	}
	table := make([]byte, 4*(n+1))
	if _, err := io.ReadFull(r, table); err != nil {
		return fmt.Errorf("offsets: %w", noEOF(err))
	}
	off := func(i int64) int64 { return int64(binary.LittleEndian.Uint32(table[4*i:])) }
	head := 4 + int64(len(table))
	if off(0) < head || off(n) != raw {
		return fmt.Errorf("offsets run from %d to %d in a shard of %d bytes whose header ends at %d", off(0), off(n), raw, head)
	}
	for i := range n {
		if off(i+1) < off(i) {
			return fmt.Errorf("sample %d: offsets go back (%d after %d)", i, off(i+1), off(i))
		}
	}
	if err := skipTo(r, pos, off(0)); err != nil {
		return err
	}
	cols := m.cols
	sizes := make([]int64, len(cols.names))
	varBuf := make([]byte, 4*cols.vars)
	for i := range n {
		start, end := off(i), off(i+1)
		if err := sample(int(i)); err != nil {
			return err
		}
		if int64(len(varBuf)) > end-start {
			return fmt.Errorf("sample %d: %d bytes cannot hold its %d column sizes", i, end-start, cols.vars)
		}
		if _, err := io.ReadFull(r, varBuf); err != nil {
			return fmt.Errorf("sample %d: %w", i, noEOF(err))
		}
		total, v := int64(len(varBuf)), 0
		for c, s := range cols.sizes {
			if s < 0 {
				s = int64(binary.LittleEndian.Uint32(varBuf[4*v:]))
				v++
			}
			sizes[c] = s
			total += s
		}
		if total != end-start {
			return fmt.Errorf("sample %d: its columns take %d bytes, its offsets %d", i, total, end-start)
		}
		at := start + int64(len(varBuf))
		for c, name := range cols.names {
			if err := field(mdsField{name: name, start: at, size: sizes[c], r: r}); err != nil {
				return err
			}
			at += sizes[c]
			if err := skipTo(r, pos, at); err != nil {
				return err
			}
		}
	}
	return nil
}

// noEOF turns a clean EOF inside a structure into ErrUnexpectedEOF.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// skipTo passes over r's bytes up to offset to.
func skipTo(r io.Reader, pos func() int64, to int64) error {
	d := to - pos()
	switch {
	case d < 0:
		return fmt.Errorf("read past byte %d (at %d)", to, pos())
	case d == 0:
		return nil
	}
	if s, ok := r.(io.Seeker); ok {
		_, err := s.Seek(d, io.SeekCurrent)
		return err
	}
	if _, err := io.CopyN(io.Discard, r, d); err != nil {
		return fmt.Errorf("at byte %d: %w", pos(), noEOF(err))
	}
	return nil
}

// mdsKey is the key of sample i of a shard: its global index.
func mdsKey(u *unit, i int) string { return strconv.FormatInt(u.first+int64(i), 10) }

// mdsSamples feeds an MDS shard's samples through the assembler: a
// sample is its columns, keyed by its global index. get returns the
// bytes of a field (called once they are charged).
func (a *assembler) mdsSamples(sh Shard, r io.Reader, pos func() int64, raw int64, get func(f mdsField) func() ([]byte, error)) error {
	u := sh.unit
	// The shard's offset table is held while it is read: charged to the
	// samples' part of the budget, as a sample is.
	table := 4 * int64(u.samples+1)
	if table > a.window/2 {
		return budget.Wrap(fmt.Errorf("%w: shard %s has %d samples, whose offsets take more than the %d bytes the read-ahead budget (%d) leaves for them; raise it",
			ErrTooLarge, printable(sh.Name), u.samples, a.window/2, a.opts.ReadAheadBytes), budget.ReadAhead)
	}
	if err := a.mem.Acquire(a.ctx, table); err != nil {
		return err
	}
	defer a.mem.Release(table)
	var key string
	return walkMDS(r, pos, raw, u.mds, u.samples, func(i int) error {
		key = mdsKey(u, i)
		return nil
	}, func(f mdsField) error {
		return a.member(sh, key+"."+f.name, key, f.name, f.size, get(f))
	})
}

// streamMDS parses an MDS shard as it is read (and decompressed), holding
// no more of it than the sample being read. Its hashes are checked once
// its last byte is read: a shard damaged there has delivered the samples
// before, as a damaged tar does.
func (a *assembler) streamMDS(sh Shard, r io.Reader, read func(int64, io.Reader) func() ([]byte, error)) error {
	m := sh.unit.mds
	if sh.Size != m.stored {
		return fmt.Errorf("%d bytes, index.json says %d", sh.Size, m.stored)
	}
	hashers := map[string]hash.Hash{}
	var ws []io.Writer
	for algo := range m.hashes {
		h := mdsHashes[algo]()
		hashers[algo] = h
		ws = append(ws, h)
	}
	stored := bufio.NewReaderSize(io.TeeReader(r, io.MultiWriter(ws...)), streamBuffer)
	var src io.Reader = stored
	if m.codec != "" {
		dec, closer, err := mdsDecompressor(m.codec, stored)
		if err != nil {
			return err
		}
		defer closer()
		src = bufio.NewReaderSize(dec, streamBuffer)
	}
	c := &counter{r: src}
	err := a.mdsSamples(sh, c, func() int64 { return c.n }, m.raw, func(f mdsField) func() ([]byte, error) {
		return read(f.size, f.r)
	})
	if err != nil {
		return err
	}
	if m.codec != "" {
		if err := expectEOF(c, m.codec, m.raw); err != nil {
			return err
		}
	}
	if _, err := io.Copy(io.Discard, stored); err != nil {
		return err
	}
	for algo, h := range hashers {
		if got := hex.EncodeToString(h.Sum(nil)); got != m.hashes[algo] {
			return fmt.Errorf("its %s is %s, index.json says %s", algo, got, m.hashes[algo])
		}
	}
	return nil
}
