package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"unicode/utf8"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// ParseHeader reads and validates the header of the safetensors file r of
// fileSize bytes. It returns the tensors sorted by offset, the metadata (nil
// when the file has none), and the file offset where the data section
// starts. Errors about the contents wrap ErrMalformed.
func ParseHeader(r io.ReaderAt, fileSize int64) (tensors []Tensor, metadata map[string]string, dataStart int64, err error) {
	raw, err := readHeader(r, fileSize)
	if err != nil {
		return nil, nil, 0, err
	}
	tensors, metadata, err = parseJSON(raw)
	if err != nil {
		return nil, nil, 0, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	dataStart = prefixLen + int64(len(raw))
	if err := checkLayout(tensors, fileSize-dataStart); err != nil {
		return nil, nil, 0, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return tensors, metadata, dataStart, nil
}

// readHeader returns the JSON header bytes, checking the declared length
// against the limits before allocating anything for it.
func readHeader(r io.ReaderAt, fileSize int64) ([]byte, error) {
	if fileSize < prefixLen {
		return nil, fmt.Errorf("%w: file of %d bytes is shorter than the %d-byte length prefix", ErrMalformed, fileSize, prefixLen)
	}
	var prefix [prefixLen]byte
	if err := readFull(r, prefix[:], 0); err != nil {
		return nil, fmt.Errorf("safetensors: read header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(prefix[:])
	if n > MaxHeaderSize {
		return nil, fmt.Errorf("%w: header length %d exceeds %d", ErrMalformed, n, MaxHeaderSize)
	}
	if n > uint64(fileSize-prefixLen) {
		return nil, fmt.Errorf("%w: header length %d runs past the end of a %d-byte file", ErrMalformed, n, fileSize)
	}
	raw := make([]byte, n)
	if err := readFull(r, raw, prefixLen); err != nil {
		return nil, fmt.Errorf("safetensors: read header: %w", err)
	}
	return raw, nil
}

// readFull is io.ReadFull for a ReaderAt: ReadAt may report io.EOF along
// with a complete read at the end of the file.
func readFull(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// tensorJSON holds a tensor entry's members by exact name: encoding/json
// matches struct fields case-insensitively, which the format does not.
type tensorJSON map[string]json.RawMessage

// parseJSON decodes the header object member by member, so duplicate names
// are caught instead of the last one silently winning.
func parseJSON(raw []byte) ([]Tensor, map[string]string, error) {
	if !utf8.Valid(raw) {
		return nil, nil, errors.New("header is not valid UTF-8")
	}
	if len(raw) == 0 || raw[0] != '{' {
		return nil, nil, errors.New("header does not start with '{'")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.Token(); err != nil {
		return nil, nil, err
	}
	var tensors []Tensor
	var metadata map[string]string
	seen := make(map[string]struct{})
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		name, ok := tok.(string)
		if !ok { // the decoder only yields strings as keys; belt and braces
			return nil, nil, fmt.Errorf("unexpected %v as a member name", tok)
		}
		if _, dup := seen[name]; dup {
			return nil, nil, fmt.Errorf("%q appears twice", name)
		}
		seen[name] = struct{}{}
		if name == metadataKey {
			if err := dec.Decode(&metadata); err != nil {
				return nil, nil, fmt.Errorf("%s: %w", metadataKey, err)
			}
			continue
		}
		t, err := decodeTensor(dec, name)
		if err != nil {
			return nil, nil, err
		}
		tensors = append(tensors, t)
	}
	if err := expectEnd(dec); err != nil {
		return nil, nil, err
	}
	return tensors, metadata, nil
}

// expectEnd consumes the closing brace and allows only whitespace after it.
func expectEnd(dec *json.Decoder) error {
	if _, err := dec.Token(); err != nil {
		return err
	}
	if tok, err := dec.Token(); err != io.EOF {
		if err == nil {
			err = fmt.Errorf("unexpected %v after the header object", tok)
		}
		return fmt.Errorf("after the header object: %w", err)
	}
	return nil
}

func decodeTensor(dec *json.Decoder, name string) (Tensor, error) {
	t := Tensor{Name: name}
	if err := checkName(name); err != nil {
		return t, err
	}
	var m tensorJSON
	if err := dec.Decode(&m); err != nil {
		return t, fmt.Errorf("tensor %q: %w", name, err)
	}
	if m == nil {
		return t, fmt.Errorf("tensor %q: not an object", name)
	}
	var dt string
	var offsets []int64
	if err := member(m, "dtype", &dt); err != nil {
		return t, fmt.Errorf("tensor %q: %w", name, err)
	}
	if err := member(m, "shape", &t.Shape); err != nil {
		return t, fmt.Errorf("tensor %q: %w", name, err)
	}
	if err := member(m, "data_offsets", &offsets); err != nil {
		return t, fmt.Errorf("tensor %q: %w", name, err)
	}
	if len(offsets) != 2 {
		return t, fmt.Errorf("tensor %q: data_offsets has %d entries, want 2", name, len(offsets))
	}
	t.DType, t.Begin, t.End = dtype.DType(dt), offsets[0], offsets[1]
	if t.Shape == nil {
		t.Shape = []int64{} // a scalar: keep "[]" distinct from a missing shape
	}
	return t, nil
}

// member decodes the required member key of m into v; JSON null counts as
// missing.
func member(m tensorJSON, key string, v any) error {
	raw, ok := m[key]
	if !ok || string(raw) == "null" {
		return fmt.Errorf("missing %q", key)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%s: %w", key, err)
	}
	return nil
}

// checkLayout sorts tensors by offset and checks that they tile a data
// section of dataLen bytes exactly.
func checkLayout(tensors []Tensor, dataLen int64) error {
	sortByOffset(tensors)
	end, err := checkTable(tensors)
	if err != nil {
		return err
	}
	if end != dataLen {
		return fmt.Errorf("tensors cover %d bytes of a %d-byte data section", end, dataLen)
	}
	return nil
}
