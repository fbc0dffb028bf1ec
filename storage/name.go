package storage

import (
	"fmt"
	"strings"
)

// MaxSegmentLen is the longest segment ValidName accepts, in bytes. It is
// NAME_MAX on Linux file systems, so any valid segment is a valid file name.
const MaxSegmentLen = 255

// ValidName reports whether name is an acceptable object name: a relative,
// slash-separated key whose segments are non-empty, are not "." or "..", and
// are at most MaxSegmentLen bytes, with no NUL byte anywhere. Such a name is
// already clean (path.Clean leaves it unchanged), so joining it to a root
// directory can never escape the root. Backslashes and other bytes are
// ordinary characters.
//
// The error wraps ErrInvalidName and quotes the name.
func ValidName(name string) error {
	if name == "" {
		return invalid(name, "empty")
	}
	if name[0] == '/' {
		return invalid(name, "absolute")
	}
	return checkSegments(name, name)
}

// ValidPrefix reports whether prefix is acceptable to Backend.List. The empty
// prefix (everything) is allowed and a prefix may end in "/". Every complete
// segment, the ones followed by a "/", obeys ValidName's rules; the final
// partial segment may be anything a segment could start with, including "."
// (it could be the start of ".x"), as long as it holds no NUL and is at most
// MaxSegmentLen bytes.
//
// The error wraps ErrInvalidName and quotes the prefix.
func ValidPrefix(prefix string) error {
	if prefix == "" {
		return nil
	}
	if prefix[0] == '/' {
		return invalid(prefix, "absolute")
	}
	dir, last := "", prefix
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		dir, last = prefix[:i], prefix[i+1:]
	}
	if dir != "" {
		if err := checkSegments(prefix, dir); err != nil {
			return err
		}
	}
	return checkBytes(prefix, last)
}

// ValidDir reports whether dir can be passed to ListDirs: "" or a valid
// prefix ending in "/".
func ValidDir(dir string) error {
	if dir != "" && !strings.HasSuffix(dir, "/") {
		return invalid(dir, `a directory must be "" or end in "/"`)
	}
	return ValidPrefix(dir)
}

// checkSegments applies the segment rules to every segment of s and
// reports errors against whole, the string the caller was given.
func checkSegments(whole, s string) error {
	for seg := range strings.SplitSeq(s, "/") {
		switch seg {
		case "":
			return invalid(whole, "empty segment")
		case ".", "..":
			return invalid(whole, fmt.Sprintf("%q segment", seg))
		}
		if err := checkBytes(whole, seg); err != nil {
			return err
		}
	}
	return nil
}

// checkBytes applies the rules that hold for partial segments too.
func checkBytes(whole, seg string) error {
	if len(seg) > MaxSegmentLen {
		return invalid(whole, fmt.Sprintf("segment longer than %d bytes", MaxSegmentLen))
	}
	if strings.IndexByte(seg, 0) >= 0 {
		return invalid(whole, "NUL byte")
	}
	return nil
}

func invalid(name, why string) error {
	return fmt.Errorf("%w %q: %s", ErrInvalidName, name, why)
}
