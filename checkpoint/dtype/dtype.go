// Package dtype names the tensor element types ckptd understands and their
// sizes. Names are the safetensors spellings ("F32", "BF16", ...) where
// safetensors has one of the same meaning, so a tensor table can be written
// to a .safetensors header without translation; for the types it lacks they
// are ckptd's own: C32 and C128 (complex of F16 and F64 parts), and torch's
// name in capitals for torch's other containers (BCOMPLEX32,
// FLOAT4_E2M1FN_X2, BITS8, UINT4, ...). How such a tensor is written to a
// .safetensors file is package internal/safetensors' (Stored).
//
// The names are written into manifests (see package checkpoint), so they
// are a storage format: change them only by adding new ones.
package dtype

import (
	"fmt"
	"math"
	"strings"
)

// DType is a tensor element type, spelled as in safetensors.
type DType string

// The supported element types. Each is the dtype of one torch (and, where
// it has one, numpy) type, with the size torch gives its elements.
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

	// The rest of torch's dtypes (all that torch 2.15 holds in a plain
	// tensor), added after the first release: older daemons refuse them.
	F8E4M3FNUZ DType = "F8_E4M3FNUZ" // torch.float8_e4m3fnuz
	F8E5M2FNUZ DType = "F8_E5M2FNUZ" // torch.float8_e5m2fnuz
	F8E8M0     DType = "F8_E8M0"     // torch.float8_e8m0fnu (MX scales)
	// F4X2 is torch.float4_e2m1fn_x2: two FP4 (E2M1) values per byte, the
	// shape counting bytes. safetensors calls the values F4, its shape
	// counting values.
	F4X2       DType = "FLOAT4_E2M1FN_X2"
	Complex32  DType = "C32"        // torch.complex32: F16 real and imaginary parts
	Complex128 DType = "C128"       // torch.complex128: F64 parts
	BComplex32 DType = "BCOMPLEX32" // torch.bcomplex32: BF16 parts
	// torch's untyped bit containers.
	Bits8   DType = "BITS8"
	Bits16  DType = "BITS16"
	Bits1x8 DType = "BITS1X8"
	Bits2x4 DType = "BITS2X4"
	Bits4x2 DType = "BITS4X2"
	// torch's sub-byte integers as torch holds them: one element per byte.
	Int1  DType = "INT1"
	Int2  DType = "INT2"
	Int3  DType = "INT3"
	Int4  DType = "INT4"
	Int5  DType = "INT5"
	Int6  DType = "INT6"
	Int7  DType = "INT7"
	UInt1 DType = "UINT1"
	UInt2 DType = "UINT2"
	UInt3 DType = "UINT3"
	UInt4 DType = "UINT4"
	UInt5 DType = "UINT5"
	UInt6 DType = "UINT6"
	UInt7 DType = "UINT7"
)

// all lists every DType with its element size, in the order errors name them.
var all = []struct {
	d    DType
	size int
}{
	{Bool, 1}, {U8, 1}, {I8, 1}, {F8E4M3, 1}, {F8E5M2, 1},
	{U16, 2}, {I16, 2}, {F16, 2}, {BF16, 2},
	{U32, 4}, {I32, 4}, {F32, 4},
	{U64, 8}, {I64, 8}, {F64, 8}, {Complex, 8},
	{F8E4M3FNUZ, 1}, {F8E5M2FNUZ, 1}, {F8E8M0, 1}, {F4X2, 1},
	{Complex32, 4}, {Complex128, 16}, {BComplex32, 4},
	{Bits8, 1}, {Bits16, 2}, {Bits1x8, 1}, {Bits2x4, 1}, {Bits4x2, 1},
	{Int1, 1}, {Int2, 1}, {Int3, 1}, {Int4, 1}, {Int5, 1}, {Int6, 1}, {Int7, 1},
	{UInt1, 1}, {UInt2, 1}, {UInt3, 1}, {UInt4, 1}, {UInt5, 1}, {UInt6, 1}, {UInt7, 1},
}

var sizes = func() map[DType]int {
	m := make(map[DType]int, len(all))
	for _, e := range all {
		m[e.d] = e.size
	}
	return m
}()

// All returns every DType, in a fixed order.
func All() []DType {
	out := make([]DType, len(all))
	for i, e := range all {
		out[i] = e.d
	}
	return out
}

var names = func() string {
	ns := make([]string, len(all))
	for i, e := range all {
		ns[i] = string(e.d)
	}
	return strings.Join(ns, " ")
}()

// Parse returns the DType named s, or an error listing what is accepted.
func Parse(s string) (DType, error) {
	d := DType(s)
	if _, ok := sizes[d]; !ok {
		return "", fmt.Errorf("unknown dtype %q (want one of %s)", s, names)
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
