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
//
// A chunk's raw length is at most MaxChunkLen (1 GiB).
//
// # Hashes
//
// A chunk hash is XXH3-64 (seed 0) written as "xxh3:" followed by 16
// lowercase hexadecimal digits, most significant first, e.g.
// "xxh3:2d06800538d394c2". The prefix names the algorithm so a later format
// can change it without guessing.
package codec
