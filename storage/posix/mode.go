package posix

import (
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
)

// DefaultFileMode is the mode of objects when Options.FileMode is zero:
// read-write for the owner, readable by the group, nothing for others.
// Checkpoints hold model weights, so a shared file system must not show
// them to everyone just because the daemon's umask is 022.
const DefaultFileMode fs.FileMode = 0o640

// ErrInvalidFileMode: a mode ValidFileMode refuses.
var ErrInvalidFileMode = errors.New("invalid file mode")

// ValidFileMode reports whether m can be Options.FileMode: permission bits
// only (at most 0777: no setuid, setgid or sticky bit), read and write for
// the owner (the daemon rewrites and deletes what it wrote), no write for
// group or others (anyone else could corrupt a checkpoint), and no execute
// bits (objects are data; folders get search bits from the read bits).
func ValidFileMode(m fs.FileMode) error {
	var why string
	switch {
	case m&^fs.ModePerm != 0:
		why = "only permission bits, at most 0777 (no setuid, setgid or sticky bit)"
	case m&0o600 != 0o600:
		why = "the owner must be able to read and write (0600)"
	case m&0o022 != 0:
		why = "group and others must not be able to write"
	case m&0o111 != 0:
		why = "objects are not executable (folders get x wherever r is set)"
	default:
		return nil
	}
	return fmt.Errorf("%w %#o: %s", ErrInvalidFileMode, uint32(m), why)
}

// ParseFileMode parses an octal mode such as "0640", "640" or "0o640" and
// checks it with ValidFileMode; it is what --file-mode takes.
func ParseFileMode(s string) (fs.FileMode, error) {
	digits := strings.TrimPrefix(strings.TrimPrefix(strings.TrimSpace(s), "0o"), "0O")
	n, err := strconv.ParseUint(digits, 8, 32)
	if err != nil || digits == "" {
		return 0, fmt.Errorf("%w %q: want an octal mode such as 0640", ErrInvalidFileMode, s)
	}
	if n > 0o777 {
		return 0, fmt.Errorf("%w %q: only permission bits, at most 0777 (no setuid, setgid or sticky bit)", ErrInvalidFileMode, s)
	}
	m := fs.FileMode(n)
	if err := ValidFileMode(m); err != nil {
		return 0, err
	}
	return m, nil
}

// folderMode is the mode of folders that hold objects of mode m: m with
// search (x) wherever read (r) is allowed.
func folderMode(m fs.FileMode) fs.FileMode {
	return m | (m&0o444)>>2
}
