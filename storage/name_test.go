package storage

import (
	"errors"
	"fmt"
	"path"
	"strings"
	"testing"
)

func TestValidName(t *testing.T) {
	long := strings.Repeat("x", MaxSegmentLen)
	tests := []struct {
		name string
		ok   bool
	}{
		{"a", true},
		{"job/steps/000000009000/rank-00000.data", true},
		{"a\\b", true},
		{".hidden", true},
		{"...", true},
		{"a/..b/c..", true},
		{"sp ace/ü", true},
		{long, true},
		{"a/" + long + "/b", true},

		{"", false},
		{"/", false},
		{"/abs", false},
		{"a/", false},
		{"a//b", false},
		{".", false},
		{"..", false},
		{"./a", false},
		{"a/.", false},
		{"a/../b", false},
		{"../a", false},
		{"a\x00b", false},
		{"\x00", false},
		{long + "x", false},
		{"a/" + long + "x", false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%.40q", tt.name), func(t *testing.T) {
			err := ValidName(tt.name)
			if tt.ok {
				if err != nil {
					t.Fatalf("ValidName(%q) = %v, want nil", tt.name, err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidName) {
				t.Fatalf("ValidName(%q) = %v, want ErrInvalidName", tt.name, err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q", tt.name)) {
				t.Errorf("error %q does not quote the name", err)
			}
		})
	}
}

func TestValidPrefix(t *testing.T) {
	long := strings.Repeat("x", MaxSegmentLen)
	tests := []struct {
		prefix string
		ok     bool
	}{
		{"", true},
		{"a", true},
		{"a/", true},
		{"a/b", true},
		{"a/b/", true},
		{"job/steps/0000", true},
		{".", true}, // start of ".x"
		{"..", true},
		{"a/.", true},
		{"a/" + long, true},

		{"/", false},
		{"/a", false},
		{"a//", false},
		{"a//b", false},
		{"./", false},
		{"../a", false},
		{"a/../b", false},
		{"a/./", false},
		{"a\x00", false},
		{"a/b\x00/", false},
		{"a/" + long + "x", false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%.40q", tt.prefix), func(t *testing.T) {
			err := ValidPrefix(tt.prefix)
			if tt.ok && err != nil {
				t.Fatalf("ValidPrefix(%q) = %v, want nil", tt.prefix, err)
			}
			if !tt.ok && !errors.Is(err, ErrInvalidName) {
				t.Fatalf("ValidPrefix(%q) = %v, want ErrInvalidName", tt.prefix, err)
			}
		})
	}
}

func FuzzValidName(f *testing.F) {
	for _, s := range []string{
		"", "a", "/a", "a/", "a//b", ".", "..", "./a", "a/../b", "a\x00b",
		"a\\b", "job/steps/000000009000/rank-00000.data", "...", ".x/..y",
		strings.Repeat("y", MaxSegmentLen), strings.Repeat("y", MaxSegmentLen+1),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		err := ValidName(name)
		if err != nil {
			if !errors.Is(err, ErrInvalidName) {
				t.Fatalf("ValidName(%q) = %v, not ErrInvalidName", name, err)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("%q", name)) {
				t.Fatalf("error %q does not quote the name", err)
			}
			return
		}
		// A valid name is clean and relative, so joining it to a root
		// directory stays inside the root.
		if path.IsAbs(name) || path.Clean(name) != name || name == "." {
			t.Fatalf("valid name %q is not clean and relative", name)
		}
		if strings.HasPrefix(name, "../") || name == ".." {
			t.Fatalf("valid name %q escapes", name)
		}
		for seg := range strings.SplitSeq(name, "/") {
			if seg == "" || seg == "." || seg == ".." || len(seg) > MaxSegmentLen || strings.ContainsRune(seg, 0) {
				t.Fatalf("valid name %q has bad segment %q", name, seg)
			}
		}
		// Every valid name, and its directory form, is a valid prefix.
		if err := ValidPrefix(name); err != nil {
			t.Fatalf("valid name %q is not a valid prefix: %v", name, err)
		}
		if err := ValidPrefix(name + "/"); err != nil {
			t.Fatalf("valid name %q + / is not a valid prefix: %v", name, err)
		}
	})
}
