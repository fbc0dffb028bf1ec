package prefetch

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
)

// Field is one part of a sample, named by its extension ("jpg", "cls").
type Field struct {
	Name string
	Data []byte
}

// Sample is one training example. Field data aliases the shard's bytes.
type Sample struct {
	Key    string
	Fields []Field
}

// Size is the bytes of the sample's fields.
func (s *Sample) Size() int64 {
	var n int64
	for _, f := range s.Fields {
		n += int64(len(f.Data))
	}
	return n
}

// parseShard cuts one shard's bytes into samples.
func parseShard(f Format, sh Shard, prefix string, data []byte) ([]Sample, error) {
	if f == Raw {
		return []Sample{rawSample(sh.Name, prefix, data)}, nil
	}
	samples, err := parseTar(data)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCorruptShard, sh.Name, err)
	}
	return samples, nil
}

func rawSample(name, prefix string, data []byte) Sample {
	rel := strings.TrimPrefix(strings.TrimPrefix(name, prefix), "/")
	key, ext := splitKey(rel)
	if ext == "" {
		ext = "bin"
	}
	return Sample{Key: key, Fields: []Field{{Name: ext, Data: data}}}
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

// parseTar groups a WebDataset tar's regular members into samples. Field
// data are slices of data, not copies. Members without an extension and
// non-file members (directories, links) are skipped, as WebDataset does.
func parseTar(data []byte) ([]Sample, error) {
	br := bytes.NewReader(data)
	tr := tar.NewReader(br)
	var out []Sample
	var end int64 // where the last member's padded data ends
	for i := 0; ; i++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out, checkTrailer(data, end)
		}
		if err != nil {
			return nil, fmt.Errorf("member %d: %w", i, err)
		}
		start := int64(len(data)) - int64(br.Len()) // archive/tar has just read the header
		if hdr.Size < 0 || hdr.Size > int64(br.Len()) {
			return nil, fmt.Errorf("member %d (%s): %d bytes declared, %d left: truncated", i, hdr.Name, hdr.Size, br.Len())
		}
		end = (start + hdr.Size + 511) &^ 511
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		key, ext := splitKey(hdr.Name)
		if ext == "" {
			continue
		}
		field := Field{Name: ext, Data: data[start : start+hdr.Size : start+hdr.Size]}
		if n := len(out); n > 0 && out[n-1].Key == key {
			out[n-1].Fields = append(out[n-1].Fields, field)
		} else {
			out = append(out, Sample{Key: key, Fields: []Field{field}})
		}
	}
}

// checkTrailer requires the two zero blocks that end a tar archive after
// the last member: archive/tar accepts an archive cut at a member boundary
// as complete, which would silently drop the samples that were cut off.
func checkTrailer(data []byte, end int64) error {
	if int64(len(data)) < end+1024 {
		return fmt.Errorf("truncated: no end-of-archive marker after byte %d", end)
	}
	for _, b := range data[end : end+1024] {
		if b != 0 {
			return fmt.Errorf("corrupt end-of-archive marker at byte %d", end)
		}
	}
	return nil
}
