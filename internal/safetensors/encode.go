package safetensors

import (
	"fmt"
	"slices"
	"strconv"
	"unicode/utf8"
)

// EncodeHeader returns the start of a safetensors file up to its data
// section: the 8-byte length and the JSON header, padded with spaces so the
// data section starts 8-byte aligned. The tensors must be given in offset
// order and tile the data section from 0 (see the package documentation);
// metadata may be nil. The data section's length is the last tensor's End.
func EncodeHeader(tensors []Tensor, metadata map[string]string) ([]byte, error) {
	if _, err := checkTable(tensors); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTable, err)
	}
	if err := checkMetadata(metadata); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTable, err)
	}
	b := make([]byte, prefixLen, prefixLen+64*(len(tensors)+len(metadata)+1))
	b = append(b, '{')
	b = appendMetadata(b, metadata)
	for i, t := range tensors {
		if i > 0 || len(metadata) > 0 {
			b = append(b, ',')
		}
		b = appendTensor(b, t)
	}
	b = append(b, '}')
	for len(b)%8 != 0 {
		b = append(b, ' ')
	}
	if n := len(b) - prefixLen; n > MaxHeaderSize {
		return nil, fmt.Errorf("%w: header of %d bytes exceeds %d", ErrInvalidTable, n, MaxHeaderSize)
	}
	putPrefix(b, len(b)-prefixLen)
	return b, nil
}

func checkMetadata(metadata map[string]string) error {
	for k, v := range metadata {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return fmt.Errorf("metadata %q: %q is not valid UTF-8", k, v)
		}
	}
	return nil
}

// appendMetadata writes the "__metadata__" member, keys sorted; nothing
// for empty metadata, as the reference writer omits it too.
func appendMetadata(b []byte, metadata map[string]string) []byte {
	if len(metadata) == 0 {
		return b
	}
	b = appendString(b, metadataKey)
	b = append(b, ":{"...)
	keys := make([]string, 0, len(metadata))
	for k := range metadata {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, k)
		b = append(b, ':')
		b = appendString(b, metadata[k])
	}
	return append(b, '}')
}

func appendTensor(b []byte, t Tensor) []byte {
	b = appendString(b, t.Name)
	b = append(b, `:{"dtype":`...)
	b = appendString(b, string(t.DType))
	b = append(b, `,"shape":[`...)
	for i, d := range t.Shape {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, d, 10)
	}
	b = append(b, `],"data_offsets":[`...)
	b = strconv.AppendInt(b, t.Begin, 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, t.End, 10)
	return append(b, "]}"...)
}

// appendString writes s, valid UTF-8, as a JSON string, escaping only what
// JSON requires so names read the same in the file as in the trainer.
func appendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\t':
			b = append(b, '\\', 't')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}
