package posix_test

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/ckptd/ckptd/storage/posix"
)

func TestParseFileMode(t *testing.T) {
	tests := []struct {
		in   string
		want fs.FileMode // 0: invalid
	}{
		{"0640", 0o640},
		{"640", 0o640},
		{"0o644", 0o644},
		{" 0600 ", 0o600},
		{"0604", 0o604},
		{"0666", 0},  // group and others write
		{"0620", 0},  // group write
		{"0642", 0},  // others write
		{"0440", 0},  // owner cannot write
		{"0240", 0},  // owner cannot read
		{"0000", 0},  // nothing
		{"0750", 0},  // executable
		{"0744", 0},  // owner execute
		{"4640", 0},  // setuid
		{"2640", 0},  // setgid
		{"1640", 0},  // sticky
		{"01000", 0}, // > 0777
		{"17777", 0}, // far more than 0777
		{"0", 0},
		{"", 0},
		{"0o", 0},
		{"rw-r-----", 0},
		{"0x1a0", 0},
		{"0649", 0}, // not octal
		{"-0640", 0},
	}
	for _, tt := range tests {
		got, err := posix.ParseFileMode(tt.in)
		if tt.want == 0 {
			if err == nil || !errors.Is(err, posix.ErrInvalidFileMode) {
				t.Errorf("ParseFileMode(%q) = %#o, %v; want ErrInvalidFileMode", tt.in, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseFileMode(%q) = %#o, %v; want %#o", tt.in, got, err, tt.want)
		}
	}
	if err := posix.ValidFileMode(fs.ModeSetuid | 0o640); !errors.Is(err, posix.ErrInvalidFileMode) {
		t.Errorf("ValidFileMode(setuid|0640) = %v, want ErrInvalidFileMode", err)
	}
	if _, err := posix.NewWithOptions(t.TempDir(), posix.Options{FileMode: 0o666}); !errors.Is(err, posix.ErrInvalidFileMode) {
		t.Errorf("NewWithOptions with FileMode 0666 = %v, want ErrInvalidFileMode", err)
	}
}

// TestModes checks the modes of objects and of every folder made for them,
// whatever the umask, for the default and wider modes.
func TestModes(t *testing.T) {
	tests := []struct {
		name      string
		mode      fs.FileMode
		file, dir fs.FileMode
	}{
		{"default", 0, 0o640, 0o750},
		{"0644", 0o644, 0o644, 0o755},
		{"0600", 0o600, 0o600, 0o700},
		{"0604", 0o604, 0o604, 0o705},
	}
	for _, umask := range []int{0, 0o077, 0o022} {
		for _, tt := range tests {
			t.Run(tt.name+"/umask-"+modeString(fs.FileMode(umask)), func(t *testing.T) {
				old := syscall.Umask(umask)
				t.Cleanup(func() { syscall.Umask(old) })
				root := filepath.Join(t.TempDir(), "new-root")
				b := open(t, root, posix.Options{FileMode: tt.mode, DirectIO: true})
				ctx := t.Context()
				big := patterned(9 << 20)
				if err := b.Put(ctx, "job/steps/1/rank.data", bytes.NewReader(big), -1); err != nil {
					t.Fatal(err)
				}
				if err := b.PutIfAbsent(ctx, "job/steps/2/COMMIT.json", []byte("{}")); err != nil {
					t.Fatal(err)
				}
				checkMode(t, root, tt.dir)
				for _, p := range []string{"job", "job/steps", "job/steps/1", "job/steps/2"} {
					checkMode(t, filepath.Join(root, p), tt.dir)
				}
				for _, p := range []string{"job/steps/1/rank.data", "job/steps/2/COMMIT.json"} {
					checkMode(t, filepath.Join(root, p), tt.file)
				}
			})
		}
	}
}

// TestModeOfExistingRoot: a root the operator made keeps its mode.
func TestModeOfExistingRoot(t *testing.T) {
	root := t.TempDir()
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	b := open(t, root, posix.Options{})
	if err := b.Put(t.Context(), "obj", bytes.NewReader(nil), 0); err != nil {
		t.Fatal(err)
	}
	checkMode(t, root, 0o711)
	checkMode(t, filepath.Join(root, "obj"), posix.DefaultFileMode)
}

func checkMode(t *testing.T, p string, want fs.FileMode) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != want {
		t.Errorf("%s has mode %s, want %s", p, modeString(got), modeString(want))
	}
}

func modeString(m fs.FileMode) string { return fmt.Sprintf("%04o", uint32(m)) }
