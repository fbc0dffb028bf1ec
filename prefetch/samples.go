package prefetch

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Field is one part of a sample, named by its extension ("jpg", "cls").
type Field struct {
	Name string
	Data []byte
}

// Sample is one training example. Field data may alias a shard the cache
// holds; otherwise it is the sample's own.
type Sample struct {
	Key    string
	Fields []Field
	cost   int64 // what it is charged to the read-ahead budget: see sampleCost
	// Where it comes from, for Delivered: its shard and its place among
	// the shard's samples, in file order.
	shard string
	ord   int
	skip  bool     // delivered before a resume: passed over, not counted
	pad   bool     // a repeat padding the rank's epoch (EvenPad)
	keep  *mapping // the mapped shard its fields alias, kept mapped while they do
}

// own gives the sample a copy of its fields' bytes, which alias a shard
// no longer kept.
func (s *Sample) own() {
	fields := make([]Field, len(s.Fields))
	for i, f := range s.Fields {
		fields[i] = Field{Name: f.Name, Data: bytes.Clone(f.Data)}
	}
	s.Fields, s.keep = fields, nil
}

// Size is the bytes of the sample's fields.
func (s *Sample) Size() int64 {
	var n int64
	for _, f := range s.Fields {
		n += int64(len(f.Data))
	}
	return n
}

// What a sample is charged: its bytes, its names, and these for the
// structures that hold them, so that a window of a million empty samples
// costs what it really does.
const (
	sampleOverhead = 96
	fieldOverhead  = 64
)

// Bounds on what one sample may be. Members beyond them make the sample
// unusable (skipped and counted with skip_corrupt, else the epoch fails).
const (
	maxKeyBytes   = 4096 // PATH_MAX
	maxFieldBytes = 255  // NAME_MAX
	maxFields     = 1024
	// maxBatchMeta bounds a batch's keys and field names as the daemon
	// holds them per delivery (and so a NextBatch response, well below the
	// Go client's 16 MiB message limit).
	maxBatchMeta = 4 << 20
)

// metaCost is what a sample's keys and names take in a delivery.
func metaCost(s *Sample) int64 {
	n := int64(48 + len(s.Key))
	for _, f := range s.Fields {
		n += int64(40 + len(f.Name))
	}
	return n
}

// splitKey splits a member path at the first dot of its base name:
// "a/b/0001.seg.png" → ("a/b/0001", "seg.png"), the WebDataset rule.
func splitKey(p string) (key, ext string) {
	dir, base := path.Split(p)
	if i := strings.IndexByte(base, '.'); i >= 0 {
		return dir + base[:i], base[i+1:]
	}
	return p, ""
}

// rawKey is the key and field name of a raw object: its name under prefix
// without the extension, and the extension ("bin" when there is none).
func rawKey(name, prefix string) (key, ext string) {
	key, ext = splitKey(strings.TrimPrefix(strings.TrimPrefix(name, prefix), "/"))
	if ext == "" {
		ext = "bin"
	}
	return key, ext
}

// badName says why a sample key or field name cannot be delivered, or "".
// Keys and names travel as protobuf strings, which must be UTF-8: rather
// than escape (and so rename) a sample, the daemon refuses it.
func badName(key, ext string) string {
	switch {
	case !utf8.ValidString(key):
		return "its key is not UTF-8"
	case !utf8.ValidString(ext):
		return "its field name is not UTF-8"
	case len(key) > maxKeyBytes:
		return fmt.Sprintf("its key is longer than %d bytes", maxKeyBytes)
	case len(ext) > maxFieldBytes:
		return fmt.Sprintf("its field name is longer than %d bytes", maxFieldBytes)
	}
	return ""
}

// printable quotes a name for a message unless it is plain UTF-8 text.
func printable(s string) string {
	if utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return r < ' ' || r == 0x7f }) < 0 {
		return s
	}
	return strconv.Quote(s)
}

// corrupt is the error of a shard that cannot be parsed, naming it.
func corrupt(sh Shard, format string, args ...any) error {
	return &ShardError{Shard: sh.Name, Detail: fmt.Sprintf(format, args...)}
}

// ShardError is a shard that cannot be parsed. It matches ErrCorruptShard
// and names the shard for clients (the server sends Shard as ErrorInfo
// metadata).
type ShardError struct {
	Shard  string // the object's name in its backend
	Detail string
}

func (e *ShardError) Error() string {
	return fmt.Sprintf("%v: %s: %s", ErrCorruptShard, printable(e.Shard), e.Detail)
}

// Is makes a ShardError match ErrCorruptShard.
func (e *ShardError) Is(target error) bool { return target == ErrCorruptShard }

// readError is a failure to read a shard from storage (not a fault of the
// shard's bytes: skip_corrupt does not skip it).
type readError struct{ err error }

func (e readError) Error() string { return e.err.Error() }
func (e readError) Unwrap() error { return e.err }

// member is one regular file of a WebDataset tar. start is where its data
// begins in the shard; its data can be read from r until the next member.
type member struct {
	name  string
	start int64
	size  int64
	r     io.Reader
}

// walkTar calls fn for each regular member of a tar of size bytes read
// from r, in order; pos says how many bytes of the tar have been read.
// Members without an extension and non-file members (directories, links)
// are skipped, as WebDataset does. A member claiming more bytes than are
// left, a sparse member (whose data would not be its bytes in the shard),
// and a tar without its end-of-archive marker are errors (archive/tar
// accepts an archive cut at a member boundary as complete, which would
// silently drop the samples cut off).
func walkTar(r io.Reader, pos func() int64, size int64, fn func(m member) error) error {
	tr := tar.NewReader(r)
	var end int64 // where the last member's padded data ends
	for i := 0; ; i++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			if pos() < end+1024 {
				return fmt.Errorf("truncated: no end-of-archive marker after byte %d", end)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("member %d: %w", i, err)
		}
		start := pos() // archive/tar has just read the header
		if hdr.Size < 0 || hdr.Size > size-start {
			return fmt.Errorf("member %d (%s): %d bytes declared, %d left: truncated", i, printable(hdr.Name), hdr.Size, size-start)
		}
		end = (start + hdr.Size + 511) &^ 511
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		for k := range hdr.PAXRecords {
			if strings.HasPrefix(k, "GNU.sparse.") {
				return fmt.Errorf("member %d (%s): sparse members are not supported", i, printable(hdr.Name))
			}
		}
		if _, ext := splitKey(hdr.Name); ext == "" {
			continue
		}
		if err := fn(member{name: hdr.Name, start: start, size: hdr.Size, r: tr}); err != nil {
			return err
		}
	}
}

// counter counts the bytes read through it.
type counter struct {
	r io.Reader
	n int64
}

func (c *counter) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
