package checkpoint

import (
	"encoding/binary"
	"math/bits"
	"sort"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// countNonFinite counts the NaN and infinite values in b, little-endian
// elements of dt (a complex element counts each part). It is 0 for a
// dtype that holds no such values (integers, bits, FP4) and for a tail
// shorter than one element.
//
// The drain runs it over every byte it compresses, so the common types go
// 8 bytes at a time: a value is not finite when its exponent field is all
// ones, and adding the field's lowest bit to the masked exponent carries
// into the lane's top bit exactly then, without crossing into the next
// lane.
func countNonFinite(dt dtype.DType, b []byte) int64 {
	switch dt {
	case dtype.BF16, dtype.BComplex32:
		return swarCount(b, 0x7F80_7F80_7F80_7F80, 0x0080_0080_0080_0080, 0x8000_8000_8000_8000, 2, 0x7F80)
	case dtype.F16, dtype.Complex32:
		return swarCount(b, 0x7C00_7C00_7C00_7C00, 0x0400_0400_0400_0400, 0x8000_8000_8000_8000, 2, 0x7C00)
	case dtype.F32, dtype.Complex:
		return swarCount(b, 0x7F80_0000_7F80_0000, 0x0080_0000_0080_0000, 0x8000_0000_8000_0000, 4, 0x7F80_0000)
	case dtype.F64, dtype.Complex128:
		return countF64(b)
	case dtype.F8E5M2:
		return countBytes(b, func(v byte) bool { return v&0x7C == 0x7C })
	case dtype.F8E4M3: // float8_e4m3fn: no infinities, NaN is S.1111.111
		return countBytes(b, func(v byte) bool { return v&0x7F == 0x7F })
	case dtype.F8E4M3FNUZ, dtype.F8E5M2FNUZ: // NaN is the negative zero's pattern
		return countBytes(b, func(v byte) bool { return v == 0x80 })
	case dtype.F8E8M0: // scales: 0xFF is NaN
		return countBytes(b, func(v byte) bool { return v == 0xFF })
	}
	return 0
}

// swarCount counts the elements of width bytes whose exponent field
// (mask, repeated per lane in m) is all ones, 8 bytes at a time: per lane,
// (v & mask) + low sets the lane's top bit (in top) only for an all-ones
// field. The tail is counted an element at a time.
func swarCount(b []byte, m, low, top uint64, width int, mask uint64) int64 {
	var n int
	for len(b) >= 32 { // four words a step: fewer bounds checks and loop turns
		v0 := binary.LittleEndian.Uint64(b)
		v1 := binary.LittleEndian.Uint64(b[8:])
		v2 := binary.LittleEndian.Uint64(b[16:])
		v3 := binary.LittleEndian.Uint64(b[24:32])
		n += bits.OnesCount64(((v0&m)+low)&top) + bits.OnesCount64(((v1&m)+low)&top) +
			bits.OnesCount64(((v2&m)+low)&top) + bits.OnesCount64(((v3&m)+low)&top)
		b = b[32:]
	}
	for len(b) >= 8 {
		n += bits.OnesCount64(((binary.LittleEndian.Uint64(b) & m) + low) & top)
		b = b[8:]
	}
	for ; len(b) >= width; b = b[width:] {
		var v uint64
		if width == 2 {
			v = uint64(binary.LittleEndian.Uint16(b))
		} else {
			v = uint64(binary.LittleEndian.Uint32(b))
		}
		if v&mask == mask {
			n++
		}
	}
	return int64(n)
}

func countF64(b []byte) int64 {
	const exp = 0x7FF0_0000_0000_0000
	var n int64
	for i := 0; i+8 <= len(b); i += 8 {
		if binary.LittleEndian.Uint64(b[i:])&exp == exp {
			n++
		}
	}
	return n
}

func countBytes(b []byte, bad func(byte) bool) int64 {
	var n int64
	for _, v := range b {
		if bad(v) {
			n++
		}
	}
	return n
}

// holdsNonFinite reports whether countNonFinite can find any value of dt.
func holdsNonFinite(dt dtype.DType) bool {
	switch dt {
	case dtype.BF16, dtype.BComplex32, dtype.F16, dtype.Complex32, dtype.F32, dtype.Complex, dtype.F64, dtype.Complex128,
		dtype.F8E5M2, dtype.F8E4M3, dtype.F8E4M3FNUZ, dtype.F8E5M2FNUZ, dtype.F8E8M0:
		return true
	}
	return false
}

// countChunk counts the non-finite values of each tensor (of tensors, the
// packed table, sorted by offset) that the chunk cp, whose bytes are raw,
// holds; only tensors with some are listed.
func countChunk(cp chunkPlan, raw []byte, tensors []Tensor) []tensorCount {
	if !holdsNonFinite(cp.dtype) {
		return nil
	}
	end := cp.rawOffset + cp.raw
	i := sort.Search(len(tensors), func(i int) bool { return tensors[i].Offset+tensors[i].Length > cp.rawOffset })
	var out []tensorCount
	for ; i < len(tensors) && tensors[i].Offset < end; i++ {
		t := tensors[i]
		from, to := max(t.Offset, cp.rawOffset)-cp.rawOffset, min(t.Offset+t.Length, end)-cp.rawOffset
		if n := countNonFinite(cp.dtype, raw[from:to]); n > 0 {
			out = append(out, tensorCount{tensor: i, n: n})
		}
	}
	return out
}
