// Package codec compresses, decompresses and hashes checkpoint chunks.
//
// The names below are written into manifests, so they and the bytes they
// describe are a storage format: a chunk written by one version of ckptd must
// be readable by every later one. Change them only by adding a new name.
//
// # Codecs
//
// A chunk is stored as exactly the bytes its codec names, with no framing of
// our own; the manifest records the raw (uncompressed) length next to the
// codec name, and that length is the only size a reader trusts.
//
//   - "none": the raw bytes, unchanged.
//   - "zstd": exactly one Zstandard frame (RFC 8878) without a dictionary.
//     The writer always sets the frame content size, even for an empty chunk,
//     and omits the frame checksum because the manifest carries a hash of its
//     own. The reader accepts any single dictionary-free frame whose content
//     decodes to the raw length, with or without a checksum or content size.
//   - "lz4": exactly one LZ4 block (the block format of
//     https://github.com/lz4/lz4/blob/dev/doc/lz4_Block_format.md), not the
//     LZ4 frame format: no magic, no header, no checksum and no length
//     prefix. An empty chunk is the single byte 0x00; a reader also accepts
//     zero bytes for it.
//   - "float-bf16", "float-f16", "float-f32", "float-f64": the float-aware
//     format below, for little-endian elements of 2, 2, 4 and 8 bytes.
//
// A chunk's raw length is at most MaxChunkLen (1 GiB).
//
// # The float-aware format
//
// Floats barely shrink under LZ coders because their mantissas are noise;
// what is redundant is the exponent, whose few common values sit in the
// same byte as the sign. The float codecs separate the bytes of each
// element into planes and code each plane on its own (after ZipNN,
// arXiv:2411.05239). With w the element size, n = rawLen / w elements and
// t = rawLen mod w:
//
//	chunk  = group* tail
//	tail   = the last t raw bytes, verbatim (rawLen need not be a multiple of w)
//	group  = block{w}          one per plane, plane 0 first
//	block  = 0x00 byte{k}                  raw: the plane's k bytes
//	       | 0x01 byte                     constant: k copies of one byte
//	       | 0x02 uvarint(L) byte{L}       Huffman: a huff0 4-stream block
//	       | 0x03 uvarint(L) op*           runs: ops of L bytes in all
//	op     = uvarint(2(m-1)) byte{m}     m literal bytes
//	       | uvarint(2(m-1)+1) byte        one byte repeated m times
//
// Groups hold 65536 elements each, the last one the rest (k bytes per plane
// block is the group's element count); there are ceil(n / 65536) groups and
// nothing follows the tail. uvarint is encoding/binary's (LEB128); L is at
// least 1. Every block decodes on its own: Huffman blocks carry their own
// table and the format has no state across blocks.
//
// Planes: each element is read little-endian; its top 16 bits are rotated
// left by one, which moves the sign bit below the exponent (for bf16 and
// fp32 the top byte is then exactly the 8-bit exponent; for fp16 the 5-bit
// exponent and 3 mantissa bits; for fp64 the top 8 of 11 exponent bits).
// The other bits stay put, so zero low halves (fp32 holding bf16 values)
// stay zero. Plane p holds byte w-1-p of the rotated element: plane 0 is
// the most significant. For example bf16 -1.0 (0xBF80) rotates to 0x7F01:
// plane 0 gets 0x7F and plane 1 gets 0x01.
//
// A Huffman block is what klauspost/compress/huff0 Compress4X writes, which
// is the Huffman-coded literals layout of Zstandard (RFC 8878): a Huffman
// tree description (section 4.2.1), a 6-byte jump table of the first three
// stream sizes (little-endian uint16s), and four bit streams coding
// consecutive quarters of the block's k symbols, each (k+3)/4 long but the
// last. A runs block's ops add up to exactly k bytes.
//
// The writer codes plane 0 with Huffman, and another plane only when one of
// its bits never changes within the block (the sign of Adam's second
// moments); it uses a constant block when every byte is equal, runs when
// they are shorter, and raw when nothing is smaller. Those are choices, not
// format: a reader accepts any block kind in any plane.
//
// # Hashes
//
// A chunk hash is XXH3-64 (seed 0) written as "xxh3:" followed by 16
// lowercase hexadecimal digits, most significant first, e.g.
// "xxh3:2d06800538d394c2". The prefix names the algorithm so a later format
// can change it without guessing.
package codec
