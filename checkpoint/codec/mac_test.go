package codec

import "testing"

// MAC is BLAKE3 keyed, its first 8 bytes little-endian: what the clients
// compute (the Python client's blake3 package gave these), and Reset
// keeps the key.
func TestMAC(t *testing.T) {
	key := make([]byte, MACKeySize)
	for i := range key {
		key[i] = byte(i)
	}
	m, err := NewMAC(key)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		data []byte
		want uint64
	}{{[]byte("abc"), 3111729887497725293}, {make([]byte, 1<<20), 6762411022668853654}} {
		m.Reset()
		m.Write(tc.data)
		if got := m.Sum64(); got != tc.want {
			t.Errorf("%d bytes: %d, want %d", len(tc.data), got, tc.want)
		}
	}
	if _, err := NewMAC(key[:16]); err == nil {
		t.Error("a 16-byte key was taken")
	}
	if a, b := NewMACKey(), NewMACKey(); string(a) == string(b) || len(a) != MACKeySize {
		t.Error("keys are not random")
	}
}
