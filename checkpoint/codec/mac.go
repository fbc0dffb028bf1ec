package codec

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"

	"github.com/zeebo/blake3"
)

// MACKeySize is the length of a MAC key.
const MACKeySize = 32

// MAC is a keyed BLAKE3 of the bytes written to it, of which Sum64 is the
// first 8 bytes, little-endian. Unlike Hash, it is a check that bytes
// crafted by someone without the key pass only by chance (2^-64): what a
// copy through memory that others can write needs.
type MAC struct{ h *blake3.Hasher }

// NewMACKey returns a random key.
func NewMACKey() []byte {
	k := make([]byte, MACKeySize)
	_, _ = rand.Read(k) // never fails (crypto/rand)
	return k
}

// NewMAC returns an empty MAC keyed with key (MACKeySize bytes).
func NewMAC(key []byte) (*MAC, error) {
	h, err := blake3.NewKeyed(key)
	if err != nil {
		return nil, fmt.Errorf("%w: a MAC key of %d bytes, not %d", ErrBadHash, len(key), MACKeySize)
	}
	return &MAC{h: h}, nil
}

// Write adds b.
func (m *MAC) Write(b []byte) { _, _ = m.h.Write(b) }

// Sum64 is the MAC of what was written.
func (m *MAC) Sum64() uint64 {
	var out [8]byte
	_, _ = m.h.Digest().Read(out[:])
	return binary.LittleEndian.Uint64(out[:])
}

// Reset empties m, keeping its key.
func (m *MAC) Reset() { m.h.Reset() }
