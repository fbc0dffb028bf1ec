// Package attempt defines the syntax of an attempt id: the run of a job a
// save belongs to, which names a folder of the store
// (<job>/steps/<step>/<attempt>/). The daemon and the Go client check ids
// with it; the Python client copies it in ckptd/_attempt.py.
package attempt

import "fmt"

// MaxLen bounds an attempt id.
const MaxLen = 64

// Check checks an attempt id: 1 to MaxLen bytes of [a-z0-9._-], not
// starting with a dot, so that it can be neither "." nor ".." nor a hidden
// folder.
func Check(a string) error {
	ok := a != "" && len(a) <= MaxLen && a[0] != '.'
	for _, c := range []byte(a) {
		ok = ok && (c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-')
	}
	if !ok {
		return fmt.Errorf("attempt %q: want 1-%d bytes of [a-z0-9._-], not starting with a dot", a, MaxLen)
	}
	return nil
}
