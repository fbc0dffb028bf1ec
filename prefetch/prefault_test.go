package prefetch

import "testing"

// prefault maps whole pages of any buffer, aligned or not, small or not,
// and leaves its bytes as they were.
func TestPrefault(t *testing.T) {
	for _, n := range []int{0, 100, 64 << 10, 1<<20 + 7} {
		b := make([]byte, n+3)
		for _, s := range [][]byte{b[:n], b[3:]} {
			prefault(s)
			for i, c := range s {
				if c != 0 {
					t.Fatalf("%d bytes: byte %d is %d", len(s), i, c)
				}
			}
		}
	}
}
