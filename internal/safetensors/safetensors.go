package safetensors

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"unicode/utf8"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// MaxHeaderSize is the largest JSON header accepted, the same limit the
// reference implementation enforces (100 MB, not MiB).
const MaxHeaderSize = 100_000_000

// prefixLen is the size of the little-endian header length.
const prefixLen = 8

// metadataKey is the reserved top-level key holding the string metadata.
const metadataKey = "__metadata__"

// ErrMalformed is wrapped by every ParseHeader error about the file's
// contents, as opposed to an error reading it.
var ErrMalformed = errors.New("malformed safetensors header")

// ErrInvalidTable is wrapped by EncodeHeader errors about its arguments.
var ErrInvalidTable = errors.New("invalid safetensors tensor table")

// Tensor describes one tensor: its name, element type, shape, and where its
// bytes lie in the data section, as the half-open range [Begin, End). The
// element type is the format's name for it (see Stored for ckptd dtypes
// the format has no name for); F4, F6_E2M3 and F6_E3M2 are no ckptd dtype.
type Tensor struct {
	Name       string
	DType      dtype.DType
	Shape      []int64
	Begin, End int64
}

// checkTable verifies that tensors, in the order given, tile the data
// section from offset 0 and that each one's size matches its dtype and
// shape. It returns the data section's length.
func checkTable(tensors []Tensor) (int64, error) {
	seen := make(map[string]struct{}, len(tensors))
	var next int64
	for _, t := range tensors {
		if err := checkName(t.Name); err != nil {
			return 0, err
		}
		if _, dup := seen[t.Name]; dup {
			return 0, fmt.Errorf("tensor %q appears twice", t.Name)
		}
		seen[t.Name] = struct{}{}
		if err := checkTensor(t, next); err != nil {
			return 0, err
		}
		next = t.End
	}
	return next, nil
}

func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("empty tensor name")
	case name == metadataKey:
		return fmt.Errorf("tensor name %q is reserved", name)
	case !utf8.ValidString(name):
		return fmt.Errorf("tensor name %q is not valid UTF-8", name)
	}
	return nil
}

// checkTensor verifies one tensor that must begin at offset begin.
func checkTensor(t Tensor, begin int64) error {
	if t.Begin != begin || t.End < t.Begin {
		return fmt.Errorf("tensor %q at [%d, %d): want it to begin at %d, where the previous one ends", t.Name, t.Begin, t.End, begin)
	}
	n, err := numBytes(t.DType, t.Shape)
	if err != nil {
		return fmt.Errorf("tensor %q: %w", t.Name, err)
	}
	if n != t.End-t.Begin {
		return fmt.Errorf("tensor %q: %s %v needs %d bytes, offsets [%d, %d) give %d", t.Name, t.DType, t.Shape, n, t.Begin, t.End, t.End-t.Begin)
	}
	return nil
}

// sortByOffset orders tensors as the data section holds them; ties (empty
// tensors) are broken by name so the order never depends on map iteration.
func sortByOffset(tensors []Tensor) {
	slices.SortFunc(tensors, func(a, b Tensor) int {
		return cmp.Or(cmp.Compare(a.Begin, b.Begin), cmp.Compare(a.End, b.End), cmp.Compare(a.Name, b.Name))
	})
}

// putPrefix writes the header length prefix.
func putPrefix(b []byte, n int) { binary.LittleEndian.PutUint64(b, uint64(n)) }
