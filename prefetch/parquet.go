package prefetch

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"strconv"
	"strings"
	"sync"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/snappy"
	"github.com/klauspost/compress/zstd"
	"github.com/parquet-go/parquet-go"
	"github.com/parquet-go/parquet-go/encoding/thrift"
	"github.com/parquet-go/parquet-go/format"
	"github.com/pierrec/lz4/v4"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

// Parquet, read with github.com/parquet-go/parquet-go behind checks of
// ckptd's own: a shard is a row group (named "file.parquet#n"), a sample
// a row, a field a leaf column (named by its top-level field when that
// holds one leaf, else by its dotted path), its bytes the value's: a byte
// array as it is, a number little endian (booleans one byte), a repeated
// column's values one after another (byte arrays each after its length,
// a uint32 little endian); a null is no field. The key is the file's name
// under the prefix, without ".parquet", then "/" and the row's index in
// the file.
//
// The library trusts what a file claims (a list's length in the footer, a
// page's sizes), so nothing reaches it unchecked: the footer is decoded
// only once a walk of its bytes (skimThrift) has bounded what decoding
// allocates, and a row group is rewritten (decodePQ) into a small
// standalone file of uncompressed pages, each decompressed here into
// exactly the size its header claims, that size checked against what the
// row group may take, its CRC checked; the library then reads that file,
// whose every size is true. The rewritten file is what the cache holds.

// Bounds on what a Parquet file may claim.
const (
	// maxPQFooter bounds a footer's bytes; maxPQFooterMem what decoding
	// one may allocate (skimThrift's count).
	maxPQFooter    = 16 << 20
	maxPQFooterMem = 64 << 20
	// maxPQPageValues bounds a page's values (the library allocates a
	// level per value, and an index per dictionary-encoded one).
	maxPQPageValues = 1 << 22
	// maxThriftDepth bounds the nesting of a footer's structures.
	maxThriftDepth = 32
)

// pqFile is a Parquet file's footer, shared by its row groups' shards.
type pqFile struct {
	md   format.FileMetaData
	size int64 // the file's bytes
	cost int64 // what it takes in memory (skimThrift's bound and the footer)
	// names are the fields' names, by leaf column.
	names []string
}

// pqRowGroup is one row group of a file.
type pqRowGroup struct {
	file  *pqFile
	index int
	key   string // the file's name under the prefix, without .parquet
}

// listParquet lists the row groups of the .parquet objects objs, in order:
// a shard each. Each file's footer is read once per daemon while the
// cache's footer budget holds it.
func listParquet(ctx context.Context, b storage.Backend, prefix string, objs []Shard, limit int64, cache *Cache) ([]Shard, error) {
	if len(objs) == 0 {
		return nil, fmt.Errorf("%w: %s has no .parquet files under prefix %q", ErrInvalid, b.Location(), printable(prefix))
	}
	var shards []Shard
	var cost int64
	for _, o := range objs {
		f, err := cache.footers.get(ctx, b, o)
		if err != nil {
			return nil, err
		}
		if cost += f.cost; cost > limit {
			return nil, budget.Wrap(fmt.Errorf("%w: the Parquet footers under %s/%s take more than the listing budget (%d) allows",
				ErrTooLarge, b.Location(), printable(prefix), limit), budget.DatasetListing)
		}
		key := strings.TrimSuffix(strings.TrimPrefix(strings.TrimPrefix(o.Name, prefix), "/"), ".parquet")
		var first int64
		for i, rg := range f.md.RowGroups {
			start, end, mem, err := pqRange(f, i)
			if err != nil {
				return nil, fmt.Errorf("%w: Parquet file %s/%s: row group %d: %w", ErrInvalid, b.Location(), printable(o.Name), i, err)
			}
			name := o.Name + "#" + strconv.Itoa(i)
			if cost += listCost(name); cost > limit {
				return nil, budget.Wrap(fmt.Errorf("%w: dataset %s/%s lists more row groups than the listing budget (%d) allows",
					ErrTooLarge, b.Location(), printable(prefix), limit), budget.DatasetListing)
			}
			shards = append(shards, Shard{Name: name, Size: end - start, ModTime: o.ModTime, unit: &unit{
				samples: int(rg.NumRows), first: first, mem: mem, object: o.Name, off: start,
				pq: &pqRowGroup{file: f, index: i, key: key},
			}})
			first += rg.NumRows
		}
	}
	if len(shards) == 0 {
		return nil, fmt.Errorf("%w: the .parquet files under %s/%s hold no row groups", ErrInvalid, b.Location(), printable(prefix))
	}
	return shards, nil
}

// pqChunkRange is where a column chunk's pages lie in its file.
func pqChunkRange(cc *format.ColumnChunk) (start, end int64) {
	md := &cc.MetaData
	start = md.DataPageOffset
	if d := md.DictionaryPageOffset; d > 0 && d < start {
		start = d
	}
	return start, start + md.TotalCompressedSize
}

// pqRange is the bytes row group i spans in its file and what its
// rewriting (decodePQ) may take, checked against the file.
func pqRange(f *pqFile, i int) (start, end, mem int64, err error) {
	rg := &f.md.RowGroups[i]
	limit := f.size - 8 - int64(len("PAR1"))
	if rg.NumRows < 0 || rg.NumRows > maxSamplesPerShard {
		return 0, 0, 0, fmt.Errorf("%d rows: ckptd reads row groups of 0 to %d", rg.NumRows, maxSamplesPerShard)
	}
	if len(rg.Columns) != len(f.names) {
		return 0, 0, 0, fmt.Errorf("%d column chunks for %d columns", len(rg.Columns), len(f.names))
	}
	start, end = math.MaxInt64, 0
	mem = 1 << 10 // the rewritten footer's row group, headers' slack
	for c := range rg.Columns {
		cc := &rg.Columns[c]
		md := &cc.MetaData
		s, e := pqChunkRange(cc)
		switch {
		case cc.FilePath != "":
			return 0, 0, 0, fmt.Errorf("column %d lies in another file (%q): ckptd reads self-contained files", c, cc.FilePath)
		case s < 4 || md.TotalCompressedSize <= 0 || e > limit || e < s:
			return 0, 0, 0, fmt.Errorf("column %d claims bytes %d to %d of a file of %d", c, s, e, f.size)
		case md.TotalUncompressedSize < 0 || md.TotalUncompressedSize > maxMDSRaw:
			return 0, 0, 0, fmt.Errorf("column %d claims %d bytes uncompressed", c, md.TotalUncompressedSize)
		}
		start, end = min(start, s), max(end, e)
		mem += md.TotalUncompressedSize + 64
	}
	if len(rg.Columns) == 0 {
		start, end = 4, 4
	}
	return start, end, mem + f.cost, nil
}

// readPQFooter reads and decodes the footer of the Parquet file o, whose
// claims are checked before anything is sized by them.
func readPQFooter(ctx context.Context, b storage.Backend, o Shard) (*pqFile, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: Parquet file %s/%s: %s", ErrInvalid, b.Location(), printable(o.Name), fmt.Sprintf(format, args...))
	}
	if o.Size < 12 {
		return nil, bad("%d bytes is too short for a Parquet file", o.Size)
	}
	tail, err := readRangeAt(ctx, b, o.Name, o.Size-8, 8)
	if err != nil {
		return nil, err
	}
	if string(tail[4:]) != "PAR1" {
		return nil, bad("no PAR1 at its end (an encrypted footer, PARE, is not read)")
	}
	n := int64(binary.LittleEndian.Uint32(tail))
	if n > o.Size-12 || n > maxPQFooter {
		return nil, bad("a footer of %d bytes in a file of %d (ckptd reads footers up to %d)", n, o.Size, maxPQFooter)
	}
	footer, err := readRangeAt(ctx, b, o.Name, o.Size-8-n, n)
	if err != nil {
		return nil, err
	}
	f, err := parsePQFooter(footer, o.Size)
	if err != nil {
		return nil, bad("%v", err)
	}
	return f, nil
}

// readRangeAt reads n bytes at off of an object.
func readRangeAt(ctx context.Context, b storage.Backend, name string, off, n int64) ([]byte, error) {
	rc, err := b.Get(ctx, name, off, n)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", printable(name), err)
	}
	defer rc.Close()
	buf := make([]byte, n)
	if _, err := io.ReadFull(rc, buf); err != nil {
		return nil, fmt.Errorf("read %s at %d: %w", printable(name), off, err)
	}
	return buf, nil
}

// parsePQFooter decodes a footer's bytes (the thrift FileMetaData) of a
// file of size bytes.
func parsePQFooter(footer []byte, size int64) (*pqFile, error) {
	cost, err := skimThrift(footer, maxPQFooterMem)
	if err != nil {
		return nil, fmt.Errorf("footer: %w", err)
	}
	f := &pqFile{size: size, cost: cost + int64(len(footer))}
	if err := thrift.Unmarshal(new(thrift.CompactProtocol), footer, &f.md); err != nil {
		return nil, fmt.Errorf("footer: %w", err)
	}
	if f.md.EncryptionAlgorithm.Value != nil {
		return nil, errors.New("it is encrypted")
	}
	if len(f.md.RowGroups) > parquet.MaxRowGroups {
		return nil, fmt.Errorf("%d row groups", len(f.md.RowGroups))
	}
	names, err := pqFieldNames(f.md.Schema)
	if err != nil {
		return nil, err
	}
	f.names = names
	// The footer's bytes are not kept: what it decoded to aliases them, so
	// they are kept, and counted in cost.
	return f, nil
}

// pqFieldNames names the leaf columns of a schema (flattened in depth-
// first order, the order of a row group's column chunks): a leaf alone
// under its top-level field takes that field's name, others their path.
func pqFieldNames(schema []format.SchemaElement) ([]string, error) {
	if len(schema) == 0 {
		return nil, errors.New("no schema")
	}
	type leaf struct{ top, path string }
	var leaves []leaf
	var walk func(i int, depth int, path []string) (int, error)
	walk = func(i int, depth int, path []string) (int, error) {
		if i >= len(schema) || depth > maxThriftDepth {
			return 0, errors.New("the schema's tree is cut short or too deep")
		}
		el := &schema[i]
		if depth > 0 {
			path = append(path, el.Name)
		}
		n := int(el.NumChildren.V)
		if n < 0 || n > len(schema)-i-1 {
			return 0, fmt.Errorf("schema element %q claims %d children", el.Name, n)
		}
		if n == 0 && depth > 0 {
			leaves = append(leaves, leaf{top: path[0], path: strings.Join(path, ".")})
			return i + 1, nil
		}
		next := i + 1
		for range n {
			var err error
			if next, err = walk(next, depth+1, path); err != nil {
				return 0, err
			}
		}
		return next, nil
	}
	end, err := walk(0, 0, nil)
	if err != nil {
		return nil, err
	}
	if end != len(schema) {
		return nil, fmt.Errorf("the schema has %d elements, its tree %d", len(schema), end)
	}
	if len(leaves) > maxFields {
		return nil, fmt.Errorf("%d columns, more than the %d fields a sample may have", len(leaves), maxFields)
	}
	perTop := map[string]int{}
	for _, l := range leaves {
		perTop[l.top]++
	}
	names := make([]string, len(leaves))
	for i, l := range leaves {
		names[i] = l.path
		if perTop[l.top] == 1 {
			names[i] = l.top
		}
		if why := badName("", names[i]); why != "" || names[i] == "" {
			return nil, fmt.Errorf("column %q: %s", names[i], why)
		}
	}
	return names, nil
}

// skimThrift walks a thrift compact struct without decoding it, checking
// that every list, set and map claims no more elements than there are
// bytes left (each takes one at least) and that structures nest at most
// maxThriftDepth deep, and returns a bound on what decoding it into
// parquet-go's format types allocates: a row group's column chunks are
// the largest list elements (560 bytes), row groups and schema elements
// ~100, everything else at most 64, and each struct 32 more (a union's
// member). It fails once the bound passes limit.
func skimThrift(b []byte, limit int64) (int64, error) {
	s := &skimmer{b: b, limit: limit}
	if err := s.structure(0, skimFileMeta); err != nil {
		return 0, err
	}
	if s.at != len(b) {
		return 0, fmt.Errorf("%w: %d bytes after its end", errSkim, len(b)-s.at)
	}
	return s.cost, nil
}

// skimHeader is skimThrift for a page header at the start of b.
func skimHeader(b []byte, limit int64) error {
	s := &skimmer{b: b, limit: limit}
	return s.structure(0, skimOther)
}

// What a struct being skimmed is, for the weight of its lists' elements.
const (
	skimOther = iota
	skimFileMeta
	skimRowGroup
)

type skimmer struct {
	b     []byte
	at    int
	cost  int64
	limit int64
}

var errSkim = errors.New("malformed thrift")

func (s *skimmer) byte1() (byte, error) {
	if s.at >= len(s.b) {
		return 0, fmt.Errorf("%w: cut short", errSkim)
	}
	c := s.b[s.at]
	s.at++
	return c, nil
}

func (s *skimmer) uvarint() (uint64, error) {
	v, n := binary.Uvarint(s.b[s.at:])
	if n <= 0 {
		return 0, fmt.Errorf("%w: bad varint at %d", errSkim, s.at)
	}
	s.at += n
	return v, nil
}

func (s *skimmer) charge(n int64) error {
	if s.cost += n; s.cost > s.limit {
		return fmt.Errorf("decoding it would take more than %d bytes", s.limit)
	}
	return nil
}

// structure skims a struct's fields up to its stop.
func (s *skimmer) structure(depth, kind int) error {
	if depth > maxThriftDepth {
		return fmt.Errorf("%w: nested deeper than %d", errSkim, maxThriftDepth)
	}
	if err := s.charge(32); err != nil {
		return err
	}
	var id int64
	for {
		h, err := s.byte1()
		if err != nil {
			return err
		}
		if h == 0 {
			return nil
		}
		if d := int64(h >> 4); d != 0 {
			id += d
		} else {
			v, err := s.uvarint() // zigzag i16
			if err != nil {
				return err
			}
			id = int64(v>>1) ^ -int64(v&1)
		}
		weight, elemKind := int64(64), skimOther
		switch {
		case kind == skimFileMeta && id == 2:
			weight = 96
		case kind == skimFileMeta && id == 4:
			weight, elemKind = 88, skimRowGroup
		case kind == skimRowGroup && id == 1:
			weight = 560
		}
		if err := s.value(h&0x0f, depth, weight, elemKind); err != nil {
			return err
		}
	}
}

// value skims one value of compact type t; a list's elements weigh
// weight each, and a struct among them is of kind.
func (s *skimmer) value(t byte, depth int, weight int64, kind int) error {
	switch t {
	case 1, 2: // bool in a field header
		return nil
	case 3: // byte
		_, err := s.byte1()
		return err
	case 4, 5, 6: // i16, i32, i64
		_, err := s.uvarint()
		return err
	case 7: // double
		if len(s.b)-s.at < 8 {
			return fmt.Errorf("%w: cut short", errSkim)
		}
		s.at += 8
		return nil
	case 8: // binary
		n, err := s.uvarint()
		if err != nil {
			return err
		}
		if n > uint64(len(s.b)-s.at) {
			return fmt.Errorf("%w: %d bytes claimed, %d left", errSkim, n, len(s.b)-s.at)
		}
		s.at += int(n)
		return nil
	case 9, 10: // list, set
		h, err := s.byte1()
		if err != nil {
			return err
		}
		n := uint64(h >> 4)
		if n == 15 {
			if n, err = s.uvarint(); err != nil {
				return err
			}
		}
		return s.elements(n, []byte{h & 0x0f}, depth, weight, kind)
	case 11: // map
		n, err := s.uvarint()
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		kv, err := s.byte1()
		if err != nil {
			return err
		}
		return s.elements(n, []byte{kv >> 4, kv & 0x0f}, depth, weight, kind)
	case 12: // struct
		return s.structure(depth+1, kind)
	}
	return fmt.Errorf("%w: type %d", errSkim, t)
}

// elements skims n elements, each the values of types in turn.
func (s *skimmer) elements(n uint64, types []byte, depth int, weight int64, kind int) error {
	if n > uint64(len(s.b)-s.at) {
		return fmt.Errorf("%w: %d elements claimed, %d bytes left", errSkim, n, len(s.b)-s.at)
	}
	if err := s.charge(int64(n) * weight * int64(len(types))); err != nil {
		return err
	}
	for range n {
		for _, t := range types {
			if t == 1 || t == 2 { // a bool element is a byte
				if _, err := s.byte1(); err != nil {
					return err
				}
				continue
			}
			if err := s.value(t, depth+1, 64, kind); err != nil {
				return err
			}
		}
	}
	return nil
}

// decodePQ rewrites a row group read whole (the bytes its column chunks
// span in its file) into a standalone Parquet file of uncompressed pages
// and a footer of that one row group: every page decompressed here into
// exactly the size its header claims, within what the row group may take.
func decodePQ(sh Shard, data shardBytes) (shardBytes, error) {
	out, err := rewritePQ(sh.unit.pq, sh.unit.off, data.b, sh.unit.mem)
	if err != nil {
		return shardBytes{}, corrupt(sh, "%v", err)
	}
	return heapBytes(out), nil
}

// rewritePQ is decodePQ on row group rg's bytes data, read at off of its
// file, in at most limit bytes.
func rewritePQ(rg *pqRowGroup, off int64, data []byte, limit int64) ([]byte, error) {
	src := &rg.file.md.RowGroups[rg.index]
	out := make([]byte, 0, min(limit, int64(len(data))*4+1024))
	out = append(out, "PAR1"...)
	chunks := make([]format.ColumnChunk, len(src.Columns))
	for c := range src.Columns {
		cc := src.Columns[c] // a copy: the file's footer stays as it was
		s, e := pqChunkRange(&cc)
		if s < off || e > off+int64(len(data)) {
			return nil, fmt.Errorf("column %d: bytes %d to %d lie outside the row group's %d to %d", c, s, e, off, off+int64(len(data)))
		}
		var err error
		if out, err = rewriteChunk(out, &cc.MetaData, data[s-off:e-off], limit, c); err != nil {
			return nil, err
		}
		cc.FileOffset = 0
		cc.OffsetIndexOffset, cc.OffsetIndexLength, cc.ColumnIndexOffset, cc.ColumnIndexLength = 0, 0, 0, 0
		cc.MetaData.IndexPageOffset, cc.MetaData.BloomFilterOffset, cc.MetaData.BloomFilterLength = 0, 0, 0
		chunks[c] = cc
	}
	md := format.FileMetaData{
		Version: rg.file.md.Version, Schema: rg.file.md.Schema, NumRows: src.NumRows, CreatedBy: "ckptd",
		RowGroups:    []format.RowGroup{{Columns: chunks, TotalByteSize: src.TotalByteSize, NumRows: src.NumRows}},
		ColumnOrders: rg.file.md.ColumnOrders,
	}
	footer, err := thrift.Marshal(new(thrift.CompactProtocol), &md)
	if err != nil {
		return nil, fmt.Errorf("footer: %w", err)
	}
	if int64(len(out)+len(footer)+8) > limit {
		return nil, fmt.Errorf("it takes more than the %d bytes its metadata says", limit)
	}
	out = append(out, footer...)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(footer)))
	return append(out, "PAR1"...), nil
}

// rewriteChunk appends a column chunk's pages, uncompressed, to out, and
// points md (a copy of its metadata) at them.
func rewriteChunk(out []byte, md *format.ColumnMetaData, chunk []byte, limit int64, c int) ([]byte, error) {
	start := int64(len(out))
	dictAt, dataAt := int64(-1), int64(-1)
	var values int64
	for len(chunk) > 0 {
		var h format.PageHeader
		if err := skimHeader(chunk, 1<<20); err != nil {
			return nil, fmt.Errorf("column %d: page header: %w", c, err)
		}
		r := new(thrift.CompactProtocol).NewReaderFromBytes(chunk)
		if err := thrift.NewDecoder(r).Decode(&h); err != nil {
			return nil, fmt.Errorf("column %d: page header: %w", c, err)
		}
		body := chunk[r.BytesRead():]
		comp, size := int64(h.CompressedPageSize), int64(h.UncompressedPageSize)
		switch {
		case comp < 0 || comp > int64(len(body)):
			return nil, fmt.Errorf("column %d: a page of %d bytes, %d left in its chunk", c, comp, len(body))
		case size < 0 || int64(len(out))+size > limit:
			return nil, fmt.Errorf("column %d: a page of %d bytes uncompressed, more than its row group may take", c, size)
		}
		page := body[:comp]
		chunk = body[comp:]
		if h.CRC != 0 && crc32.ChecksumIEEE(page) != uint32(h.CRC) {
			return nil, fmt.Errorf("column %d: a page's CRC differs", c)
		}
		n, levels, err := pageShape(&h)
		if err != nil {
			return nil, fmt.Errorf("column %d: %w", c, err)
		}
		raw := page
		if md.Codec != format.Uncompressed && !(h.Type == format.DataPageV2 && h.DataPageHeaderV2.Valid && h.DataPageHeaderV2.V.IsCompressed.Valid && !h.DataPageHeaderV2.V.IsCompressed.V) {
			if levels > int64(len(page)) || levels > size {
				return nil, fmt.Errorf("column %d: levels of %d bytes in a page of %d", c, levels, len(page))
			}
			rest, err := decompressPage(md.Codec, page[levels:], size-levels)
			if err != nil {
				return nil, fmt.Errorf("column %d: %w", c, err)
			}
			raw = append(page[:levels:levels], rest...)
		} else if int64(len(page)) != size {
			return nil, fmt.Errorf("column %d: an uncompressed page of %d bytes claims %d", c, len(page), size)
		}
		switch h.Type {
		case format.DictionaryPage:
			if dictAt < 0 {
				dictAt = int64(len(out))
			}
		case format.DataPage, format.DataPageV2:
			if dataAt < 0 {
				dataAt = int64(len(out))
			}
			values += n
		}
		if h.DataPageHeaderV2.Valid {
			h.DataPageHeaderV2.V.IsCompressed = thrift.New(false)
		}
		h.CompressedPageSize, h.CRC = h.UncompressedPageSize, 0
		hb, err := thrift.Marshal(new(thrift.CompactProtocol), &h)
		if err != nil {
			return nil, fmt.Errorf("column %d: page header: %w", c, err)
		}
		if int64(len(out)+len(hb)+len(raw)) > limit {
			return nil, fmt.Errorf("column %d: it takes more than the %d bytes its row group's metadata says", c, limit)
		}
		out = append(append(out, hb...), raw...)
	}
	if dataAt < 0 {
		return nil, fmt.Errorf("column %d: no data page", c)
	}
	if values > md.NumValues && md.NumValues >= 0 {
		return nil, fmt.Errorf("column %d: its pages hold %d values, its metadata says %d", c, values, md.NumValues)
	}
	md.Codec = format.Uncompressed
	md.DataPageOffset, md.DictionaryPageOffset = dataAt, 0
	if dictAt >= 0 {
		md.DictionaryPageOffset = dictAt
	}
	md.TotalCompressedSize = int64(len(out)) - start
	md.TotalUncompressedSize = md.TotalCompressedSize
	return out, nil
}

// pageShape checks a page header's counts and returns its values and the
// bytes of its (uncompressed) levels, for a data page v2.
func pageShape(h *format.PageHeader) (values, levels int64, err error) {
	switch h.Type {
	case format.DataPage:
		if !h.DataPageHeader.Valid {
			return 0, 0, errors.New("a data page without its header")
		}
		values = int64(h.DataPageHeader.V.NumValues)
	case format.DataPageV2:
		if !h.DataPageHeaderV2.Valid {
			return 0, 0, errors.New("a data page v2 without its header")
		}
		v := &h.DataPageHeaderV2.V
		if v.NumNulls < 0 || v.NumRows < 0 || v.DefinitionLevelsByteLength < 0 || v.RepetitionLevelsByteLength < 0 {
			return 0, 0, errors.New("a data page v2 with negative counts")
		}
		values = int64(v.NumValues)
		levels = int64(v.DefinitionLevelsByteLength) + int64(v.RepetitionLevelsByteLength)
	case format.DictionaryPage:
		if !h.DictionaryPageHeader.Valid {
			return 0, 0, errors.New("a dictionary page without its header")
		}
		values = int64(h.DictionaryPageHeader.V.NumValues)
	default:
		return 0, 0, fmt.Errorf("a page of type %d, which ckptd does not read", h.Type)
	}
	if values < 0 || values > maxPQPageValues {
		return 0, 0, fmt.Errorf("a page of %d values (ckptd reads pages of up to %d)", values, maxPQPageValues)
	}
	return values, levels, nil
}

// decompressPage decompresses a page's data into exactly size bytes.
func decompressPage(codec format.CompressionCodec, src []byte, size int64) ([]byte, error) {
	out := make([]byte, size)
	switch codec {
	case format.Snappy:
		n, err := snappy.DecodedLen(src)
		if err != nil || int64(n) != size {
			return nil, fmt.Errorf("snappy: %d bytes claimed, %d (%v) found", size, n, err)
		}
		if _, err := snappy.Decode(out, src); err != nil {
			return nil, fmt.Errorf("snappy: %w", err)
		}
		return out, nil
	case format.Lz4Raw:
		n, err := lz4.UncompressBlock(src, out)
		if err != nil || int64(n) != size {
			return nil, fmt.Errorf("lz4: %d bytes claimed, %d (%v) found", size, n, err)
		}
		return out, nil
	}
	var r io.Reader
	switch codec {
	case format.Gzip:
		g, err := gzip.NewReader(bytes.NewReader(src))
		if err != nil {
			return nil, fmt.Errorf("gzip: %w", err)
		}
		r = g
	case format.Zstd:
		d := zstdPages.Get().(*zstd.Decoder)
		defer zstdPages.Put(d)
		if err := d.Reset(bytes.NewReader(src)); err != nil {
			return nil, fmt.Errorf("zstd: %w", err)
		}
		r = d
	case format.Brotli:
		r = brotli.NewReader(bytes.NewReader(src))
	default:
		return nil, fmt.Errorf("compression %s, which ckptd does not read", codec)
	}
	if _, err := io.ReadFull(r, out); err != nil {
		return nil, fmt.Errorf("%s: %w (%d bytes claimed)", codec, err, size)
	}
	if err := expectEOF(r, codec.String(), size); err != nil {
		return nil, err
	}
	return out, nil
}

// zstdPages are zstd stream decoders, synchronous, their windows bounded.
var zstdPages = sync.Pool{New: func() any {
	d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true), zstd.WithDecoderMaxWindow(mdsMaxWindow))
	if err != nil {
		panic(err) // only for bad options
	}
	return d
}}

// pqSamples feeds a rewritten row group's rows through the assembler.
func (a *assembler) pqSamples(sh Shard, data []byte) error {
	u := sh.unit
	names := u.pq.file.names
	return readPQRows(data, u.samples, len(names), func(row int, fields [][]byte, present []bool) error {
		key := u.pq.key + "/" + strconv.FormatInt(u.first+int64(row), 10)
		some := false
		for c, name := range names {
			if !present[c] {
				continue
			}
			some = true
			field := fields[c]
			if err := a.member(sh, key+"."+name, key, name, int64(len(field)), func() ([]byte, error) { return bytes.Clone(field), nil }); err != nil {
				return err
			}
		}
		if !some {
			return a.emptySample(sh, key)
		}
		return nil
	})
}

// readPQRows reads the rows of a rewritten row group (a standalone file)
// that should hold rows rows of columns leaf columns, calling fn with each
// row's fields (valid until it returns) and which are present (not null).
func readPQRows(data []byte, rows, columns int, fn func(row int, fields [][]byte, present []bool) error) (err error) {
	defer func() {
		// The library panics on some malformed pages (an index out of
		// range): the row group is corrupt, the daemon goes on.
		if r := recover(); r != nil {
			if _, ours := r.(fnPanic); ours {
				panic(r)
			}
			err = fmt.Errorf("the Parquet reader failed on it: %v", r)
		}
	}()
	f, err := parquet.OpenFile(bytes.NewReader(data), int64(len(data)), parquet.SkipPageIndex(true), parquet.SkipBloomFilters(true))
	if err != nil {
		return err
	}
	groups := f.RowGroups()
	if len(groups) != 1 || len(f.Schema().Columns()) != columns {
		return fmt.Errorf("%d row groups and %d columns once rewritten", len(groups), len(f.Schema().Columns()))
	}
	leaves := f.Schema().Columns()
	repeated := make([]bool, columns)
	for c, path := range leaves {
		if leaf, ok := f.Schema().Lookup(path...); ok {
			repeated[c] = leaf.MaxRepetitionLevel > 0
		}
	}
	rr := groups[0].Rows()
	defer rr.Close()
	buf := make([]parquet.Row, 16)
	fields, present := make([][]byte, columns), make([]bool, columns)
	n, idle := 0, 0
	for {
		k, err := rr.ReadRows(buf)
		switch {
		case k > 0:
			idle = 0
		case err == nil:
			if idle++; idle > 100 { // the library goes nowhere on a malformed page
				return fmt.Errorf("the reader stopped after %d rows", n)
			}
		}
		for _, row := range buf[:k] {
			if n >= rows {
				return fmt.Errorf("more rows than the %d its metadata says", rows)
			}
			for c := range fields {
				fields[c], present[c] = fields[c][:0], false
			}
			for _, v := range row {
				c := v.Column()
				if c < 0 || c >= columns || v.IsNull() {
					continue
				}
				if repeated[c] && (v.Kind() == parquet.ByteArray || v.Kind() == parquet.FixedLenByteArray) {
					fields[c] = binary.LittleEndian.AppendUint32(fields[c], uint32(len(v.ByteArray())))
				}
				fields[c] = v.AppendBytes(fields[c])
				present[c] = true
			}
			if err := callRow(fn, n, fields, present); err != nil {
				return err
			}
			n++
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
	}
	if n != rows {
		return fmt.Errorf("%d rows, its metadata says %d", n, rows)
	}
	return nil
}

// fnPanic carries a panic of readPQRows' callback through its recover:
// only the library's panics are the row group's fault.
type fnPanic struct{ v any }

func callRow(fn func(int, [][]byte, []bool) error, n int, fields [][]byte, present []bool) (err error) {
	defer func() {
		if r := recover(); r != nil {
			panic(fnPanic{r})
		}
	}()
	return fn(n, fields, present)
}

// footerCache keeps the footers of the Parquet files read, for every
// session of the daemon, within a byte budget (a full one starts over:
// a footer is read again), and reads each once for all the sessions that
// want it at the same time.
type footerCache struct {
	mu      sync.Mutex
	files   map[string]*pqFile
	cost    int64
	budget  int64
	flights map[string]*footerFlight
}

type footerFlight struct {
	done chan struct{}
	f    *pqFile
	err  error
}

// FooterBytes bounds the memory the Parquet footers kept take: part of
// MemoryCeiling.
const FooterBytes = 64 << 20

func newFooterCache(budget int64) *footerCache {
	return &footerCache{files: map[string]*pqFile{}, budget: budget, flights: map[string]*footerFlight{}}
}

func (fc *footerCache) get(ctx context.Context, b storage.Backend, o Shard) (*pqFile, error) {
	key := shardKey(b, o)
	fc.mu.Lock()
	if f := fc.files[key]; f != nil {
		fc.mu.Unlock()
		return f, nil
	}
	fl := fc.flights[key]
	if fl == nil {
		fl = &footerFlight{done: make(chan struct{})}
		fc.flights[key] = fl
		fc.mu.Unlock()
		fl.f, fl.err = readPQFooter(ctx, b, o)
		fc.mu.Lock()
		delete(fc.flights, key)
		if fl.err == nil && fl.f.cost <= fc.budget {
			if fc.cost+fl.f.cost > fc.budget {
				fc.files, fc.cost = map[string]*pqFile{}, 0
			}
			fc.files[key] = fl.f
			fc.cost += fl.f.cost
		}
		fc.mu.Unlock()
		close(fl.done)
		return fl.f, fl.err
	}
	fc.mu.Unlock()
	select {
	case <-fl.done:
		return fl.f, fl.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
