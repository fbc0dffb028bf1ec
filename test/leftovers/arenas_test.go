package leftovers

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// defaultArenaDaemon prepares a daemon with its arena in the default
// place, /dev/shm/ckptd-<uid>-<hash of its socket>, which it returns; the
// folder is removed when the test ends, whatever happened.
func defaultArenaDaemon(t *testing.T) (*daemontest.Daemon, string) {
	dir := t.TempDir()
	d := &daemontest.Daemon{T: t, Socket: filepath.Join(dir, "ckptd.sock"), Storage: filepath.Join(dir, "store")}
	d.Args = append([]string{"serve", "--socket", d.Socket, "--storage", d.Storage}, daemontest.DefaultArgs...)
	sum := sha256.Sum256([]byte(d.Socket))
	arena := fmt.Sprintf("/dev/shm/ckptd-%d-%s", os.Getuid(), hex.EncodeToString(sum[:6]))
	t.Cleanup(func() { d.Stop(); os.RemoveAll(arena) })
	return d, arena
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// A daemon killed with SIGKILL leaves its arena in /dev/shm; the next
// start of any daemon of the user removes it, unless its journal holds
// staged saves: that one stays, and drains when its daemon comes back.
// ckptd cleanup does the same on demand.
func TestDeadDaemonsArenas(t *testing.T) {
	a, arenaA := defaultArenaDaemon(t)
	b, arenaB := defaultArenaDaemon(t)
	// A daemon of a test package running beside this one may reap a's
	// arena before b does (every start reaps): a is then started and
	// killed again, up to three times.
	for try := 1; ; try++ {
		a.Start()
		a.Kill9()
		if exists(arenaA) {
			b.Start()
			daemontest.WaitUntil(t, "the dead daemon's arena to go", func() bool { return !exists(arenaA) })
			if strings.Contains(b.Logs(), "removed the arena of a daemon that is gone") && strings.Contains(b.Logs(), a.Socket) {
				break
			}
			b.Stop()
		}
		if try == 3 {
			t.Fatalf("b never removed a's arena itself (something else did each time):\n%s", b.Logs())
		}
	}

	// A daemon killed with a save staged: its arena stays for its restart.
	a.Start("--debug-drain-delay", "1h")
	req := daemontest.Shard(3, 0, 1)
	daemontest.Save(t, a.Client(), req)
	a.Kill9()
	b.Stop()
	b.Start()
	if !exists(arenaA) || !strings.Contains(b.Logs(), "kept the arena of a daemon that is gone") {
		t.Fatalf("the arena holding a staged save was not kept (exists %v):\n%s", exists(arenaA), b.Logs())
	}
	out, stderr, err := daemontest.CLI(t, "cleanup", "--dry-run")
	if err != nil || !strings.Contains(out, arenaA) || !strings.Contains(out, "kept") {
		t.Fatalf("cleanup --dry-run: %v\n%s%s", err, out, stderr)
	}
	a.Start()
	c := a.Client()
	if err := daemontest.WaitStep(t, c, 3, 0); err != nil {
		t.Fatal(err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 3})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, req)

	// ckptd cleanup never touches a running daemon's arena, and removes a
	// dead one's. Every daemon start reaps too, so a daemon of a test
	// package running beside this one may take b's arena first: b is then
	// started and killed again, up to three times.
	for try := 1; ; try++ {
		b.Kill9()
		out, stderr, err = daemontest.CLI(t, "cleanup")
		if err != nil || strings.Contains(out, arenaA) || exists(arenaB) || !exists(arenaA) {
			t.Fatalf("cleanup with daemon a running and b dead: %v\n%s%s", err, out, stderr)
		}
		if strings.Contains(out, arenaB) {
			break
		}
		if try == 3 {
			t.Fatalf("cleanup never found b's arena, which something else removed each time:\n%s", out)
		}
		b.Start()
	}
}
