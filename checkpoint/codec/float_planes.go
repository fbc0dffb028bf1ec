package codec

import "encoding/binary"

// Byte planes of float elements.
//
// split turns k little-endian elements of width w into w planes of k bytes
// each; merge undoes it. Before splitting, the top 16 bits of each element
// are rotated left by one, which moves the sign bit from the top of the
// exponent to the bottom of the next byte: plane 0 then holds nothing but
// exponent bits (all 8 of bf16 and fp32, the top 8 of fp64, the 5 of fp16
// with 3 mantissa bits), whose few common values Huffman-code well, and the
// sign rides with mantissa bits that are noise anyway. Plane p holds byte
// w-1-p of the rotated element, most significant first. Only the top 16
// bits rotate so that zero low halves stay zero: fp32 tensors holding
// upcast bf16 values have two all-zero planes.
//
// The loops work a machine word at a time (SWAR): the drain splits every
// float byte it stores, so a byte-at-a-time loop (about 1 GB/s) would cost
// as much as the entropy coder. The *Scalar versions are the reference the
// tests compare against, and handle the elements left over after the last
// full word-sized batch.

const (
	lo8x8   = 0x00FF00FF00FF00FF
	lo16x4  = 0x0000FFFF0000FFFF
	lo32    = 0x00000000FFFFFFFF
	hi32    = 0xFFFFFFFF00000000
	rot16Lo = 0x0001000100010001
)

// split writes the planes of the k elements in src (k*w bytes) to
// planes[p][:k].
func split(w int, src []byte, planes *[8][]byte, k int) {
	switch w {
	case 2:
		split2(src, planes[0][:k], planes[1][:k])
	case 4:
		split4(src, planes, k)
	case 8:
		split8(src, planes, k)
	}
}

// merge is the inverse of split: it writes k elements to dst (k*w bytes).
func merge(w int, dst []byte, planes *[8][]byte, k int) {
	switch w {
	case 2:
		merge2(dst, planes[0][:k], planes[1][:k])
	case 4:
		merge4(dst, planes, k)
	case 8:
		merge8(dst, planes, k)
	}
}

// rotTop16 rotates each 16-bit lane of v left by one: for 2-byte elements
// that is the whole element.
func rotTop16(v uint64) uint64 {
	return (v<<1)&^rot16Lo | (v>>15)&rot16Lo
}

// unrotTop16 is the inverse of rotTop16.
func unrotTop16(v uint64) uint64 {
	return (v>>1)&^(rot16Lo<<15) | (v<<15)&(rot16Lo<<15)
}

// rot32 rotates the top 16 bits of each 32-bit lane left by one.
func rot32(v uint64) uint64 {
	return v&lo16x4 | (v<<1)&0xFFFE0000FFFE0000 | (v>>15)&0x0001000000010000
}

func unrot32(v uint64) uint64 {
	return v&lo16x4 | (v>>1)&0x7FFF00007FFF0000 | (v<<15)&0x8000000080000000
}

// rot64 rotates the top 16 bits of a 64-bit element left by one.
func rot64(v uint64) uint64 {
	return v&0x0000FFFFFFFFFFFF | (v<<1)&0xFFFE000000000000 | (v>>15)&0x0001000000000000
}

func unrot64(v uint64) uint64 {
	return v&0x0000FFFFFFFFFFFF | (v>>1)&0x7FFF000000000000 | (v<<15)&0x8000000000000000
}

// evens packs bytes 0, 2, 4 and 6 of x into the low 32 bits.
func evens(x uint64) uint64 {
	x &= lo8x8
	x = (x | x>>8) & lo16x4
	return (x | x>>16) & lo32
}

// spread is the inverse of evens: the 4 low bytes of x go to bytes 0, 2,
// 4 and 6.
func spread(x uint64) uint64 {
	x &= lo32
	x = (x | x<<16) & lo16x4
	return (x | x<<8) & lo8x8
}

func split2(src, p0, p1 []byte) {
	k := len(p0)
	i := 0
	for ; i+8 <= k; i += 8 {
		s := src[2*i : 2*i+16]
		a := rotTop16(binary.LittleEndian.Uint64(s))
		b := rotTop16(binary.LittleEndian.Uint64(s[8:]))
		binary.LittleEndian.PutUint64(p0[i:i+8], evens(a>>8)|evens(b>>8)<<32)
		binary.LittleEndian.PutUint64(p1[i:i+8], evens(a)|evens(b)<<32)
	}
	split2Scalar(src[2*i:], p0[i:], p1[i:])
}

func merge2(dst, p0, p1 []byte) {
	k := len(p0)
	i := 0
	for ; i+8 <= k; i += 8 {
		e := binary.LittleEndian.Uint64(p0[i : i+8])
		m := binary.LittleEndian.Uint64(p1[i : i+8])
		d := dst[2*i : 2*i+16]
		binary.LittleEndian.PutUint64(d, unrotTop16(spread(e)<<8|spread(m)))
		binary.LittleEndian.PutUint64(d[8:], unrotTop16(spread(e>>32)<<8|spread(m>>32)))
	}
	merge2Scalar(dst[2*i:], p0[i:], p1[i:])
}

// transpose8 transposes the 8×8 byte matrix whose row r is x_r (byte c of
// a row being column c): it returns the columns. It is its own inverse.
// Three rounds swap 1-, 2- and 4-byte blocks (Hacker's Delight 7-3): 72
// word operations for 64 bytes, all in registers (the register ABI passes
// and returns the eight words without touching memory).
func transpose8(x0, x1, x2, x3, x4, x5, x6, x7 uint64) (uint64, uint64, uint64, uint64, uint64, uint64, uint64, uint64) {
	x0, x1 = swapBlocks(x0, x1, 8, lo8x8)
	x2, x3 = swapBlocks(x2, x3, 8, lo8x8)
	x4, x5 = swapBlocks(x4, x5, 8, lo8x8)
	x6, x7 = swapBlocks(x6, x7, 8, lo8x8)
	x0, x2 = swapBlocks(x0, x2, 16, lo16x4)
	x1, x3 = swapBlocks(x1, x3, 16, lo16x4)
	x4, x6 = swapBlocks(x4, x6, 16, lo16x4)
	x5, x7 = swapBlocks(x5, x7, 16, lo16x4)
	x0, x4 = swapBlocks(x0, x4, 32, lo32)
	x1, x5 = swapBlocks(x1, x5, 32, lo32)
	x2, x6 = swapBlocks(x2, x6, 32, lo32)
	x3, x7 = swapBlocks(x3, x7, 32, lo32)
	return x0, x1, x2, x3, x4, x5, x6, x7
}

// swapBlocks exchanges the odd blocks of a with the even blocks of b
// (blocks of s bits; m selects the even ones).
func swapBlocks(a, b uint64, s uint, m uint64) (uint64, uint64) {
	t := (a>>s ^ b) & m
	return a ^ t<<s, b ^ t
}

// split4 takes 16 elements at a time. Row r of the matrix is element r in
// its low half and element r+8 in its high half, so after transposing, row
// b is byte b of elements 0..7 and row b+4 byte b of elements 8..15: each
// plane gets 16 bytes in element order with two stores.
func split4(src []byte, planes *[8][]byte, k int) {
	p0, p1, p2, p3 := planes[0][:k], planes[1][:k], planes[2][:k], planes[3][:k]
	i := 0
	for ; i+16 <= k; i += 16 {
		s := src[4*i : 4*i+64]
		x0, x1 := rows4(s[0:8], s[32:40])
		x2, x3 := rows4(s[8:16], s[40:48])
		x4, x5 := rows4(s[16:24], s[48:56])
		x6, x7 := rows4(s[24:32], s[56:64])
		x0, x1, x2, x3, x4, x5, x6, x7 = transpose8(x0, x1, x2, x3, x4, x5, x6, x7)
		put16(p3[i:i+16], x0, x4)
		put16(p2[i:i+16], x1, x5)
		put16(p1[i:i+16], x2, x6)
		put16(p0[i:i+16], x3, x7)
	}
	split4Scalar(src[4*i:], p0[i:], p1[i:], p2[i:], p3[i:])
}

func merge4(dst []byte, planes *[8][]byte, k int) {
	p0, p1, p2, p3 := planes[0][:k], planes[1][:k], planes[2][:k], planes[3][:k]
	i := 0
	for ; i+16 <= k; i += 16 {
		x0, x4 := get16(p3[i : i+16])
		x1, x5 := get16(p2[i : i+16])
		x2, x6 := get16(p1[i : i+16])
		x3, x7 := get16(p0[i : i+16])
		x0, x1, x2, x3, x4, x5, x6, x7 = transpose8(x0, x1, x2, x3, x4, x5, x6, x7)
		d := dst[4*i : 4*i+64]
		unrows4(d[0:8], d[32:40], x0, x1)
		unrows4(d[8:16], d[40:48], x2, x3)
		unrows4(d[16:24], d[48:56], x4, x5)
		unrows4(d[24:32], d[56:64], x6, x7)
	}
	merge4Scalar(dst[4*i:], p0[i:], p1[i:], p2[i:], p3[i:])
}

// rows4 makes rows 2j and 2j+1 from the words holding elements 2j, 2j+1
// (lo) and 2j+8, 2j+9 (hi), rotated.
func rows4(lo, hi []byte) (uint64, uint64) {
	a := rot32(binary.LittleEndian.Uint64(lo))
	b := rot32(binary.LittleEndian.Uint64(hi))
	return a&lo32 | b<<32, a>>32 | b&hi32
}

// unrows4 is the inverse of rows4.
func unrows4(lo, hi []byte, r0, r1 uint64) {
	binary.LittleEndian.PutUint64(lo, unrot32(r0&lo32|r1<<32))
	binary.LittleEndian.PutUint64(hi, unrot32(r0>>32|r1&hi32))
}

// split8 takes 8 elements at a time: each is a row, and after transposing
// row b is byte b of all eight.
func split8(src []byte, planes *[8][]byte, k int) {
	i := 0
	for ; i+8 <= k; i += 8 {
		s := src[8*i : 8*i+64]
		x0, x1, x2, x3, x4, x5, x6, x7 := transpose8(
			rot64(le64(s[0:8])), rot64(le64(s[8:16])), rot64(le64(s[16:24])), rot64(le64(s[24:32])),
			rot64(le64(s[32:40])), rot64(le64(s[40:48])), rot64(le64(s[48:56])), rot64(le64(s[56:64])))
		put64(planes[7][i:i+8], x0)
		put64(planes[6][i:i+8], x1)
		put64(planes[5][i:i+8], x2)
		put64(planes[4][i:i+8], x3)
		put64(planes[3][i:i+8], x4)
		put64(planes[2][i:i+8], x5)
		put64(planes[1][i:i+8], x6)
		put64(planes[0][i:i+8], x7)
	}
	split8Scalar(src[8*i:], planes, i, k)
}

func merge8(dst []byte, planes *[8][]byte, k int) {
	i := 0
	for ; i+8 <= k; i += 8 {
		x0, x1, x2, x3, x4, x5, x6, x7 := transpose8(
			le64(planes[7][i:i+8]), le64(planes[6][i:i+8]), le64(planes[5][i:i+8]), le64(planes[4][i:i+8]),
			le64(planes[3][i:i+8]), le64(planes[2][i:i+8]), le64(planes[1][i:i+8]), le64(planes[0][i:i+8]))
		d := dst[8*i : 8*i+64]
		put64(d[0:8], unrot64(x0))
		put64(d[8:16], unrot64(x1))
		put64(d[16:24], unrot64(x2))
		put64(d[24:32], unrot64(x3))
		put64(d[32:40], unrot64(x4))
		put64(d[40:48], unrot64(x5))
		put64(d[48:56], unrot64(x6))
		put64(d[56:64], unrot64(x7))
	}
	merge8Scalar(dst[8*i:], planes, i, k)
}

func le64(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }

func put64(b []byte, v uint64) { binary.LittleEndian.PutUint64(b, v) }

func put16(b []byte, lo, hi uint64) {
	binary.LittleEndian.PutUint64(b[:8], lo)
	binary.LittleEndian.PutUint64(b[8:16], hi)
}

func get16(b []byte) (lo, hi uint64) {
	return binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint64(b[8:16])
}

// The scalar reference versions: one element at a time.

func split2Scalar(src, p0, p1 []byte) {
	for i := range p0 {
		v := binary.LittleEndian.Uint16(src[2*i:])
		v = v<<1 | v>>15
		p0[i], p1[i] = byte(v>>8), byte(v)
	}
}

func merge2Scalar(dst, p0, p1 []byte) {
	for i := range p0 {
		v := uint16(p0[i])<<8 | uint16(p1[i])
		binary.LittleEndian.PutUint16(dst[2*i:], v>>1|v<<15)
	}
}

func split4Scalar(src, p0, p1, p2, p3 []byte) {
	for i := range p0 {
		v := binary.LittleEndian.Uint32(src[4*i:])
		h := uint16(v >> 16)
		h = h<<1 | h>>15
		p0[i], p1[i], p2[i], p3[i] = byte(h>>8), byte(h), byte(v>>8), byte(v)
	}
}

func merge4Scalar(dst, p0, p1, p2, p3 []byte) {
	for i := range p0 {
		h := uint16(p0[i])<<8 | uint16(p1[i])
		h = h>>1 | h<<15
		binary.LittleEndian.PutUint32(dst[4*i:], uint32(h)<<16|uint32(p2[i])<<8|uint32(p3[i]))
	}
}

// split8Scalar splits elements from..k-1; src starts at element from.
func split8Scalar(src []byte, planes *[8][]byte, from, k int) {
	for i := from; i < k; i++ {
		v := rot64(binary.LittleEndian.Uint64(src[8*(i-from):]))
		for p := range 8 {
			planes[p][i] = byte(v >> (8 * (7 - p)))
		}
	}
}

func merge8Scalar(dst []byte, planes *[8][]byte, from, k int) {
	for i := from; i < k; i++ {
		var v uint64
		for p := range 8 {
			v |= uint64(planes[p][i]) << (8 * (7 - p))
		}
		binary.LittleEndian.PutUint64(dst[8*(i-from):], unrot64(v))
	}
}
