package codec

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/zeebo/xxh3"
)

const hashPrefix = "xxh3:"

// ErrBadHash is wrapped by ParseHash errors.
var ErrBadHash = errors.New("malformed hash")

// Hash returns the XXH3-64 digest of b.
func Hash(b []byte) uint64 { return xxh3.Hash(b) }

// HashString returns b's digest in the form manifests store it.
func HashString(b []byte) string { return FormatHash(Hash(b)) }

// copyBlock is how much CopyHash hashes and copies at a time: small enough
// to stay in a core's cache between the two, so the source is read from
// memory once.
const copyBlock = 128 << 10

// CopyHash copies src into dst (which must be as long) and returns the
// XXH3-64 digest of what it copied, read back from dst while it is in
// cache: one pass over memory for what a Hash then a copy read twice. The
// digest describes dst even if src changes meanwhile (another process
// writing shared memory), so a copy can be trusted by its hash.
func CopyHash(dst, src []byte) uint64 {
	if len(src) <= copyBlock {
		copy(dst, src)
		return xxh3.Hash(dst[:len(src)])
	}
	h := xxh3.New()
	for off := 0; off < len(src); off += copyBlock {
		end := min(off+copyBlock, len(src))
		copy(dst[off:end], src[off:end])
		_, _ = h.Write(dst[off:end])
	}
	return h.Sum64()
}

// FormatHash writes h in the manifest form "xxh3:" + 16 lowercase hex digits.
func FormatHash(h uint64) string {
	const digits = "0123456789abcdef"
	var buf [len(hashPrefix) + 16]byte
	copy(buf[:], hashPrefix)
	for i := len(buf) - 1; i >= len(hashPrefix); i-- {
		buf[i] = digits[h&0xf]
		h >>= 4
	}
	return string(buf[:])
}

// ParseHash reads the form FormatHash writes and nothing else (no upper
// case, no missing digits), so a parsed hash always formats back to the
// same string.
func ParseHash(s string) (uint64, error) {
	if len(s) != len(hashPrefix)+16 || s[:len(hashPrefix)] != hashPrefix {
		return 0, fmt.Errorf("%w %q (want %q and 16 lowercase hex digits)", ErrBadHash, s, hashPrefix)
	}
	var h uint64
	for _, c := range []byte(s[len(hashPrefix):]) {
		var d byte
		switch {
		case '0' <= c && c <= '9':
			d = c - '0'
		case 'a' <= c && c <= 'f':
			d = c - 'a' + 10
		default:
			return 0, fmt.Errorf("%w %q: %q is not a lowercase hex digit", ErrBadHash, s, c)
		}
		h = h<<4 | uint64(d)
	}
	return h, nil
}

const keyPrefix = "xxh3-128:"

// Key returns the content key of b: its XXH3-128 digest, as
// "xxh3-128:" and 32 lowercase hex digits. Incremental saves reference an
// earlier chunk whose key, raw length and Hash all equal a new chunk's:
// 64 bits alone would make a false match possible over a store's
// lifetime (a birthday bound near 2^32 chunks); 128 bits push it to 2^64.
func Key(b []byte) string {
	sum := xxh3.Hash128(b).Bytes()
	return keyPrefix + hex.EncodeToString(sum[:])
}

// ParseKey checks that s is in the form Key writes (lowercase hex).
func ParseKey(s string) error {
	digits, ok := strings.CutPrefix(s, keyPrefix)
	if !ok || len(digits) != 32 || strings.ToLower(digits) != digits {
		return fmt.Errorf("%w: key %q (want %q and 32 lowercase hex digits)", ErrBadHash, s, keyPrefix)
	}
	if _, err := hex.DecodeString(digits); err != nil {
		return fmt.Errorf("%w: key %q: %v", ErrBadHash, s, err)
	}
	return nil
}
