package posix_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// fallbacks are the ways PutIfAbsent can publish, each forced by hiding
// the ones before it.
var fallbacks = []struct {
	name  string
	setup func(testing.TB)
}{
	{"link", func(testing.TB) {}},
	{"rename-noreplace", posix.SimulateNoHardLinks},
}

// TestPutIfAbsentNeitherLinkNorNoReplace: without both, PutIfAbsent
// refuses, naming the file system, and leaves nothing behind.
func TestPutIfAbsentNeitherLinkNorNoReplace(t *testing.T) {
	posix.SimulateNoHardLinks(t)
	posix.SimulateNoRenameNoReplace(t)
	b := newBackend(t, "", posix.Options{})
	err := b.PutIfAbsent(t.Context(), "job/steps/1/COMMIT.json", []byte(`{"step": 1}`))
	if !errors.Is(err, posix.ErrNoAtomicCreate) || !strings.Contains(err.Error(), "magic 0x") {
		t.Fatalf("PutIfAbsent = %v, want ErrNoAtomicCreate naming the file system", err)
	}
	checkMissingObject(t, b, "job/steps/1/COMMIT.json")
	if entries, _ := os.ReadDir(b.Root()); len(entries) != 0 {
		t.Errorf("a refused PutIfAbsent left %v in the root", entries)
	}
	// An object that exists is still reported as such.
	if err := b.Put(t.Context(), "x", bytes.NewReader([]byte("x")), 1); err != nil {
		t.Fatal(err)
	}
	if err := b.PutIfAbsent(t.Context(), "x", []byte("y")); !errors.Is(err, storage.ErrExists) {
		t.Errorf("PutIfAbsent over an object = %v, want ErrExists", err)
	}
}

func checkMissingObject(t *testing.T, b storage.Backend, name string) {
	t.Helper()
	if _, err := b.Stat(t.Context(), name); !errors.Is(err, storage.ErrNotFound) {
		t.Errorf("Stat(%s) = %v, want ErrNotFound", name, err)
	}
}

const crashEnv = "CKPTD_POSIX_CRASH_HELPER"

// TestPutIfAbsentCrash kills a process (SIGKILL) in the middle of
// PutIfAbsent, before and after it publishes, with each fallback, and
// checks that the name then holds nothing or the whole object: never a
// part that would block a commit forever.
func TestPutIfAbsentCrash(t *testing.T) {
	if os.Getenv(crashEnv) != "" {
		t.Skip("in the helper process")
	}
	data := patterned(3<<20 + 17)
	const name = "job/steps/000000000001/COMMIT.json"
	for _, fb := range fallbacks {
		for _, step := range []string{"synced", "published"} {
			t.Run(fb.name+"/"+step, func(t *testing.T) {
				root := t.TempDir()
				killAt(t, root, fb.name, step)
				b := open(t, root, posix.Options{})
				ctx := t.Context()
				if step == "synced" {
					checkMissingObject(t, b, name)
					if temps := tempFiles(t, root); len(temps) != 1 {
						t.Errorf("want the dead writer's temporary file, found %q", temps)
					}
					if err := b.PutIfAbsent(ctx, name, []byte("after")); err != nil {
						t.Fatalf("PutIfAbsent after the crash: %v", err)
					}
					if got := readObject(t, b, name); string(got) != "after" {
						t.Errorf("after the crash the object holds %d bytes", len(got))
					}
					return
				}
				if got := readObject(t, b, name); !bytes.Equal(got, data) {
					t.Errorf("a crash after publishing left %d bytes, want the whole %d", len(got), len(data))
				}
				if err := b.PutIfAbsent(ctx, name, []byte("after")); !errors.Is(err, storage.ErrExists) {
					t.Errorf("PutIfAbsent after the crash = %v, want ErrExists", err)
				}
			})
		}
	}
}

// killAt runs TestPutIfAbsentCrashHelper in a new process, waits until its
// PutIfAbsent reaches step, and kills it with SIGKILL.
func killAt(t *testing.T, root, fallback, step string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestPutIfAbsentCrashHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashEnv+"="+strings.Join([]string{root, fallback, step}, ","))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "reached "+step+"\n" {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("helper said %q (%v), want it to reach %s", line, err, step)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
}

// TestPutIfAbsentCrashHelper is the process TestPutIfAbsentCrash kills.
func TestPutIfAbsentCrashHelper(t *testing.T) {
	args := strings.Split(os.Getenv(crashEnv), ",")
	if len(args) != 3 {
		t.Skip("a helper for TestPutIfAbsentCrash; runs only in the process it starts")
	}
	root, fallback, step := args[0], args[1], args[2]
	for _, fb := range fallbacks {
		if fb.name == fallback {
			fb.setup(t)
		}
	}
	posix.SetCrashPoint(t, func(s string) {
		if s == step {
			os.Stdout.WriteString("reached " + s + "\n")
			time.Sleep(time.Minute) // until killed
		}
	})
	b, err := posix.New(root)
	if err != nil {
		t.Fatal(err)
	}
	err = b.PutIfAbsent(t.Context(), "job/steps/000000000001/COMMIT.json", patterned(3<<20+17))
	t.Fatalf("PutIfAbsent returned (%v) instead of being killed at %s", err, step)
}

func tempFiles(t *testing.T, root string) []string {
	t.Helper()
	var temps []string
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && posix.IsTempName(d.Name()) {
			temps = append(temps, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return temps
}
