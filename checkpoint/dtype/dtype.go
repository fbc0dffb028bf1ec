// Package dtype names the tensor element types ckptd understands and their
// sizes. Names are the safetensors spellings ("F32", "BF16", ...), so a
// tensor table can be written to a .safetensors header without translation.
//
// The names are written into manifests (see package checkpoint), so they
// are a storage format: change them only by adding new ones.
package dtype

import (
	"fmt"
	"math"
)

// DType is a tensor element type, spelled as in safetensors.
type DType string

// The supported element types.
const (
	Bool    DType = "BOOL"
	U8      DType = "U8"
	I8      DType = "I8"
	F8E4M3  DType = "F8_E4M3"
	F8E5M2  DType = "F8_E5M2"
	U16     DType = "U16"
	I16     DType = "I16"
	F16     DType = "F16"
	BF16    DType = "BF16"
	U32     DType = "U32"
	I32     DType = "I32"
	F32     DType = "F32"
	U64     DType = "U64"
	I64     DType = "I64"
	F64     DType = "F64"
	Complex DType = "C64"
)

var sizes = map[DType]int{
	Bool: 1, U8: 1, I8: 1, F8E4M3: 1, F8E5M2: 1,
	U16: 2, I16: 2, F16: 2, BF16: 2,
	U32: 4, I32: 4, F32: 4,
	U64: 8, I64: 8, F64: 8, Complex: 8,
}

// Parse returns the DType named s, or an error listing what is accepted.
func Parse(s string) (DType, error) {
	d := DType(s)
	if _, ok := sizes[d]; !ok {
		return "", fmt.Errorf("unknown dtype %q (want one of BOOL U8 I8 F8_E4M3 F8_E5M2 U16 I16 F16 BF16 U32 I32 F32 U64 I64 F64 C64)", s)
	}
	return d, nil
}

// Size is the width of one element in bytes (0 for an unknown dtype).
func (d DType) Size() int { return sizes[d] }

// IsFloat reports whether the type holds IEEE-like floating point values,
// which the float-aware codec can split into exponent and mantissa planes.
func (d DType) IsFloat() bool {
	switch d {
	case F16, BF16, F32, F64:
		return true
	}
	return false
}

// NumBytes returns the byte length of a tensor of this type and shape, or
// an error when a dimension is negative or the product overflows int64.
func (d DType) NumBytes(shape []int64) (int64, error) {
	n := int64(d.Size())
	if n == 0 {
		return 0, fmt.Errorf("unknown dtype %q", string(d))
	}
	for _, dim := range shape {
		if dim < 0 {
			return 0, fmt.Errorf("negative dimension %d in shape %v", dim, shape)
		}
		if dim != 0 && n > math.MaxInt64/dim {
			return 0, fmt.Errorf("shape %v overflows", shape)
		}
		n *= dim
	}
	return n, nil
}
