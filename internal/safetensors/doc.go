// Package safetensors reads and writes the header of a .safetensors file,
// the format `ckptd restore` writes so that the huggingface safetensors
// library (and anything built on it) can load a restored checkpoint.
//
// # Format
//
// A file is, in order (https://github.com/huggingface/safetensors):
//
//  1. N, the header length, as an unsigned 64-bit little-endian integer;
//  2. N bytes of UTF-8 JSON: one object mapping each tensor name to
//     {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//     plus an optional "__metadata__" object of string values;
//  3. the data section: every tensor's bytes, little-endian and row-major,
//     at [begin, end) relative to the start of this section.
//
// The tensors must tile the data section exactly: sorted by offset, the
// first begins at 0, each begins where the previous one ends, the last ends
// at the end of the file, and each spans its dtype's width × product(shape)
// bits, a whole number of bytes (F4 and F6_* are narrower than a byte). The
// dtypes are the format's (dtypes.go); ForFile writes ckptd's as them.
// The JSON may be followed by spaces; writers pad it so that the data
// section starts at a multiple of 8, which EncodeHeader does too.
//
// EncodeHeader writes the metadata first and then the tensors in offset
// order, as compact JSON with map keys sorted, so the same table always
// gives the same bytes. ParseHeader treats its input as untrusted: it bounds
// what it reads by MaxHeaderSize and the file size before allocating, and
// checks everything listed above.
package safetensors
