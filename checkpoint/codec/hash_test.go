package codec

import (
	"bytes"
	"errors"
	"testing"
)

func TestHashKnownValues(t *testing.T) {
	// Reference values from the XXH3 C implementation (XXH3_64bits).
	if got := Hash(nil); got != 0x2d06800538d394c2 {
		t.Errorf("Hash(empty) = %#x", got)
	}
	if got, want := FormatHash(Hash(nil)), "xxh3:2d06800538d394c2"; got != want {
		t.Errorf("FormatHash = %q, want %q", got, want)
	}
}

func TestFormatParseHash(t *testing.T) {
	for _, h := range []uint64{0, 1, 0xdeadbeef, 1 << 63, ^uint64(0), Hash([]byte("abc"))} {
		s := FormatHash(h)
		if len(s) != 21 {
			t.Errorf("FormatHash(%#x) = %q", h, s)
		}
		got, err := ParseHash(s)
		if err != nil || got != h {
			t.Errorf("ParseHash(%q) = %#x, %v; want %#x", s, got, err, h)
		}
	}
	if got := FormatHash(0xab); got != "xxh3:00000000000000ab" {
		t.Errorf("FormatHash(0xab) = %q", got)
	}
}

func TestParseHashRejects(t *testing.T) {
	for _, s := range []string{
		"",
		"xxh3:",
		"xxh3:2d06800538d394c",   // 15 digits
		"xxh3:2d06800538d394c2f", // 17 digits
		"xxh3:2D06800538D394C2",  // upper case
		"XXH3:2d06800538d394c2",
		"xxh64:2d06800538d394c",
		"2d06800538d394c2",
		"xxh3:+d06800538d394c2",
		"xxh3:0x06800538d394c2",
		"xxh3:2d06800538d394g2",
		"xxh3 2d06800538d394c2",
	} {
		if _, err := ParseHash(s); !errors.Is(err, ErrBadHash) {
			t.Errorf("ParseHash(%q) error = %v, want ErrBadHash", s, err)
		}
	}
}

func FuzzParseHash(f *testing.F) {
	f.Add("xxh3:2d06800538d394c2")
	f.Add("xxh3:ffffffffffffffff")
	f.Add("xxh3:FFFFFFFFFFFFFFFF")
	f.Add("xxh3:")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		h, err := ParseHash(s)
		if err != nil {
			return
		}
		if back := FormatHash(h); back != s {
			t.Fatalf("ParseHash(%q) = %#x, which formats as %q", s, h, back)
		}
	})
}

// CopyHash copies exactly and hashes as Hash does, at every size around
// its block boundaries.
func TestCopyHash(t *testing.T) {
	src := make([]byte, 3*copyBlock+17)
	for i := range src {
		src[i] = byte(i*31 + i>>9)
	}
	for _, n := range []int{0, 1, 1023, copyBlock, copyBlock + 1, 2*copyBlock - 5, len(src)} {
		dst := make([]byte, n)
		if got, want := CopyHash(dst, src[:n]), Hash(src[:n]); got != want {
			t.Fatalf("%d bytes: hash %#x, want %#x", n, got, want)
		}
		if !bytes.Equal(dst, src[:n]) {
			t.Fatalf("%d bytes: copy differs", n)
		}
	}
}
