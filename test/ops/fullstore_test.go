package ops

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// A full store (ENOSPC on a real tmpfs) is an outage like any other: once
// the arena is full, saves move to --spill-dir and new ones are accepted,
// none refused; when the store has room again (the operator grew it), every
// acknowledged save commits byte for byte and the spill folder empties.
func TestFullStoreSpills(t *testing.T) {
	store := mountTmpfs(t, "size=16m")
	spill := filepath.Join(t.TempDir(), "spill")
	d := daemontest.Start(t, store, "--staging-bytes", "32MiB", "--spill-dir", spill, "--staging-wait", "1m", "--codec", "none")
	c := d.Client()
	var saved []*ckptd.SaveRequest
	for step := int64(1); step <= 10; step++ { // 6 MiB each: 60 MiB against 16 in the store and 32 in the arena
		req := daemontest.Shard(step, 0, 1)
		if _, err := c.Save(daemontest.Ctx(t), req); err != nil {
			t.Fatalf("save of step %d into a full store: %v\n%s", step, err, d.Logs())
		}
		saved = append(saved, req)
	}
	if daemontest.Spilled(spill) == 0 {
		t.Fatalf("60 MiB through a 32 MiB arena into a 16 MiB store, and nothing spilled:\n%s", d.Logs())
	}
	daemontest.WaitUntil(t, "a drain to find the store full", func() bool {
		return strings.Contains(d.Logs(), "no space left on device")
	})
	if err := syscall.Mount("tmpfs", store, "tmpfs", syscall.MS_REMOUNT, "size=256m"); err != nil {
		t.Fatal(err)
	}
	daemontest.CommittedAsSaved(t, d, c, saved) // once the store has room
	daemontest.WaitUntil(t, "the spill folder to empty", func() bool { return daemontest.Spilled(spill) == 0 })
}

// mountTmpfs mounts a tmpfs of these options on a new folder until the
// test ends. CI runs as root, where this must work.
func mountTmpfs(t *testing.T, options string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, options); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("mount a tmpfs (CI runs as root): %v", err)
		}
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}
