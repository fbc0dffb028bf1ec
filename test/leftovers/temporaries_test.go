package leftovers

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// tempRow is a row of `ckptd list --all --json` for a temporary.
type tempRow struct {
	Step    int64     `json:"step"`
	Attempt string    `json:"attempt"`
	State   string    `json:"state"`
	Bytes   int64     `json:"bytes"`
	Newest  time.Time `json:"newest"`
	Object  string    `json:"object"`
}

// temporaries is what `ckptd list --all` shows of temporaries.
func temporaries(t *testing.T, storage string) []tempRow {
	t.Helper()
	out, stderr, err := daemontest.CLI(t, "list", "--storage", storage, "--job", "e2e", "--all", "--json")
	if err != nil {
		t.Fatalf("ckptd list --all --json: %v\n%s", err, stderr)
	}
	var rows, temps []tempRow
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("list --all --json: %v\n%s", err, out)
	}
	for _, r := range rows {
		if r.State == "temporary" {
			temps = append(temps, r)
		}
	}
	return temps
}

// tmpFiles are the temporary files of ranks' objects under a POSIX
// store's step folder (a commit's own temporary is there for a moment
// after its record appears).
func tmpFiles(t *testing.T, storage string, step string) []string {
	t.Helper()
	var names []string
	filepath.WalkDir(filepath.Join(storage, "e2e", "steps", step), func(p string, de os.DirEntry, err error) error {
		if err == nil && !de.IsDir() && strings.Contains(de.Name(), ".tmp-") && strings.HasPrefix(de.Name(), ".rank-") {
			names = append(names, p)
		}
		return nil
	})
	return names
}

// killMidWrite saves req on a daemon whose writes stall, waits until the
// rank's data object is being written, and kills the daemon with SIGKILL.
func killMidWrite(t *testing.T, d *daemontest.Daemon, req *ckptd.SaveRequest) {
	t.Helper()
	d.Start("--debug-stall-writes-after", "1MiB")
	daemontest.Save(t, d.Client(), req)
	daemontest.WaitUntil(t, "the data object's write to begin", func() bool {
		return len(temporaries(t, d.Storage)) > 0
	})
	d.Kill9()
}

// A kill -9 in the middle of a POSIX write leaves a temporary file: list
// --all shows it, prune removes it once idle for --gc-grace, and the
// journaled save still commits when the daemon comes back.
func TestKilledWriteThenPrune(t *testing.T) {
	d := daemontest.New(t, "", "", daemontest.DefaultArgs...)
	req := daemontest.Shard(7, 0, 1)
	killMidWrite(t, d, req)

	temps := temporaries(t, d.Storage)
	if len(temps) != 1 || temps[0].Step != 7 || temps[0].Attempt != daemontest.Attempt ||
		!strings.HasSuffix(temps[0].Object, "/rank-00000.data") {
		t.Fatalf("list --all shows temporaries %+v, want the one of step 7's rank 0 data", temps)
	}
	out, stderr, err := daemontest.CLI(t, "list", "--storage", d.Storage, "--job", "e2e", "--all")
	if err != nil || !strings.Contains(out, "temporary") || !strings.Contains(out, "rank-00000.data") {
		t.Fatalf("list --all: %v\n%s%s", err, out, stderr)
	}

	// A temporary written to within the grace may be a live write: kept.
	out, stderr, err = daemontest.CLI(t, "prune", "--storage", d.Storage, "--job", "e2e", "--keep-last", "1", "--gc-grace", "1h")
	if err != nil || !strings.Contains(out, "and 0 temporaries") || len(tmpFiles(t, d.Storage, "000000000007")) != 1 {
		t.Fatalf("prune within the grace: %v\n%s%s", err, out, stderr)
	}
	daemontest.WaitUntil(t, "the temporary to be idle for a second", func() bool {
		return time.Since(temporaries(t, d.Storage)[0].Newest) > 1500*time.Millisecond
	})
	out, stderr, err = daemontest.CLI(t, "prune", "--storage", d.Storage, "--job", "e2e", "--keep-last", "1", "--gc-grace", "1s", "--dry-run")
	if err != nil || !strings.Contains(out, "would remove") || !strings.Contains(out, "and 1 temporaries") ||
		len(tmpFiles(t, d.Storage, "000000000007")) != 1 {
		t.Fatalf("prune --dry-run past the grace: %v\n%s%s", err, out, stderr)
	}
	out, stderr, err = daemontest.CLI(t, "prune", "--storage", d.Storage, "--job", "e2e", "--keep-last", "1", "--gc-grace", "1s")
	if err != nil || !strings.Contains(out, "and 1 temporaries") {
		t.Fatalf("prune past the grace: %v\n%s%s", err, out, stderr)
	}
	if left := tmpFiles(t, d.Storage, "000000000007"); len(left) != 0 || len(temporaries(t, d.Storage)) != 0 {
		t.Fatalf("after prune the store holds temporaries %v", left)
	}

	d.Start()
	c := d.Client()
	if err := daemontest.WaitStep(t, c, 7, 0); err != nil {
		t.Fatal(err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 7})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, req)
}

// A daemon that replays a journaled save whose write a kill -9 cut
// removes what that write left at once: only that save writes there.
func TestReplayRemovesItsTemporaries(t *testing.T) {
	d := daemontest.New(t, "", "", daemontest.DefaultArgs...)
	req := daemontest.Shard(9, 0, 1)
	killMidWrite(t, d, req)
	if n := len(tmpFiles(t, d.Storage, "000000000009")); n != 1 {
		t.Fatalf("after the kill the step folder holds %d temporary files, want 1", n)
	}
	d.Start()
	c := d.Client()
	if err := daemontest.WaitStep(t, c, 9, 0); err != nil {
		t.Fatal(err)
	}
	if left := tmpFiles(t, d.Storage, "000000000009"); len(left) != 0 {
		t.Errorf("after the replay the store holds temporaries %v", left)
	}
	if !strings.Contains(d.Logs(), "removed what an earlier write of a replayed save left") {
		t.Errorf("the replay's removal is not logged:\n%s", d.Logs())
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 9})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, req)
}
