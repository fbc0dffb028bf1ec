package codec

import (
	"errors"
	"fmt"

	"github.com/zeebo/xxh3"
)

const hashPrefix = "xxh3:"

// ErrBadHash is wrapped by ParseHash errors.
var ErrBadHash = errors.New("malformed hash")

// Hash returns the XXH3-64 digest of b.
func Hash(b []byte) uint64 { return xxh3.Hash(b) }

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
