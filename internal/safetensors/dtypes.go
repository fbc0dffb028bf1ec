package safetensors

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// bits is every element type the format names, with its width in bits, as
// the reference implementation (0.8) knows them. ckptd's dtypes have the
// same names where the format has one; Stored says how the others go into
// a file.
var bits = map[dtype.DType]int64{
	"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
	"F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
	"I16": 16, "U16": 16, "F16": 16, "BF16": 16,
	"I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

var bitNames = func() string {
	ns := make([]string, 0, len(bits))
	for d := range bits {
		ns = append(ns, string(d))
	}
	slices.Sort(ns)
	return strings.Join(ns, " ")
}()

// numBytes is the length of a tensor of the format's dtype dt and shape.
// Sub-byte types (F4, F6_*) must fill whole bytes, as the reference
// implementation requires.
func numBytes(dt dtype.DType, shape []int64) (int64, error) {
	b, ok := bits[dt]
	if !ok {
		return 0, fmt.Errorf("unknown safetensors dtype %q (want one of %s)", dt, bitNames)
	}
	n, err := dtype.U8.NumBytes(shape) // the number of elements
	if err != nil {
		return 0, err
	}
	if n > math.MaxInt64/b {
		return 0, fmt.Errorf("shape %v overflows", shape)
	}
	if n*b%8 != 0 {
		return 0, fmt.Errorf("%s %v is %d bits, not a whole number of bytes", dt, shape, n*b)
	}
	return n * b / 8, nil
}

// MetadataDTypes is the metadata key under which a file written by
// ForFile names the ckptd dtype of each tensor it stores under another
// dtype: a JSON object mapping tensor names to dtypes, e.g.
// {"model:x": "C128"}.
const MetadataDTypes = "ckptd.dtypes"

// Stored returns how a file holds a tensor of ckptd dtype d and shape: the
// format's dtype and the shape under it, and whether that is d itself
// (false: the format has no name for d, and its bytes are stored as
// another dtype's). The bytes never change:
//
//   - FLOAT4_E2M1FN_X2 (torch's float4_e2m1fn_x2: two FP4 values per byte)
//     is F4, the format's name for the values, with the last dimension
//     doubled (it counts values, not bytes), as the reference library
//     writes torch's tensors; a 0-d one becomes shape [2];
//   - the complex types the format lacks (C128, C32, BCOMPLEX32) are their
//     parts (F64, F16, BF16) with a last dimension of 2, real then
//     imaginary, as torch.view_as_real gives them;
//   - torch's bit containers and one-per-byte sub-byte integers (BITS8,
//     BITS16, INT4, UINT4, ...) are the unsigned integers of their width.
//
// Every other ckptd dtype is the format's own name.
func Stored(d dtype.DType, shape []int64) (dtype.DType, []int64, bool) {
	switch d {
	case dtype.F4X2:
		if len(shape) == 0 {
			return "F4", []int64{2}, true
		}
		out := slices.Clone(shape)
		if last := out[len(out)-1]; last <= math.MaxInt64/2 {
			out[len(out)-1] = 2 * last
		}
		return "F4", out, true
	case dtype.Complex128:
		return dtype.F64, append(slices.Clone(shape), 2), false
	case dtype.Complex32:
		return dtype.F16, append(slices.Clone(shape), 2), false
	case dtype.BComplex32:
		return dtype.BF16, append(slices.Clone(shape), 2), false
	case dtype.Bits16:
		return dtype.U16, shape, false
	case dtype.Bits8, dtype.Bits1x8, dtype.Bits2x4, dtype.Bits4x2,
		dtype.Int1, dtype.Int2, dtype.Int3, dtype.Int4, dtype.Int5, dtype.Int6, dtype.Int7,
		dtype.UInt1, dtype.UInt2, dtype.UInt3, dtype.UInt4, dtype.UInt5, dtype.UInt6, dtype.UInt7:
		return dtype.U8, shape, false
	}
	return d, shape, true
}

// ForFile turns a table of tensors of ckptd dtypes into the file's
// (Stored), and returns metadata with MetadataDTypes naming those stored
// under another dtype (metadata itself is not changed; it is returned as
// it is when there are none).
func ForFile(tensors []Tensor, metadata map[string]string) ([]Tensor, map[string]string) {
	out := make([]Tensor, len(tensors))
	other := map[string]dtype.DType{}
	for i, t := range tensors {
		dt, shape, own := Stored(t.DType, t.Shape)
		out[i] = Tensor{Name: t.Name, DType: dt, Shape: shape, Begin: t.Begin, End: t.End}
		if !own {
			other[t.Name] = t.DType
		}
	}
	if len(other) == 0 {
		return out, metadata
	}
	m := maps.Clone(metadata)
	if m == nil {
		m = map[string]string{}
	}
	b, _ := json.Marshal(other) // keys sorted: the same table gives the same bytes
	m[MetadataDTypes] = string(b)
	return out, m
}
