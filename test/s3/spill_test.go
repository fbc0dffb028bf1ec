package s3

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// With MinIO down, a trainer saving 60 MiB through a 32 MiB arena is not
// refused: saves waiting to drain move to --spill-dir. The daemon is then
// killed with saves in the arena and in the spill folder; once MinIO and
// the daemon are back, every acknowledged save commits, byte for byte,
// and the spill folder empties.
func TestS3SpillDuringOutage(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	spill := filepath.Join(t.TempDir(), "spill")
	d := daemontest.StartEnv(t, store, srv.Env(), "--staging-bytes", "32MiB", "--spill-dir", spill, "--staging-wait", "1m")
	c := d.Client()
	srv.Kill()
	var saved []*ckptd.SaveRequest
	for step := int64(1); step <= 10; step++ { // 6 MiB each
		req := daemontest.Shard(step, 0, 1)
		if _, err := c.Save(daemontest.Ctx(t), req); err != nil {
			t.Fatalf("save of step %d with MinIO down: %v\n%s", step, err, d.Logs())
		}
		saved = append(saved, req)
	}
	if spilled(spill) == 0 {
		t.Fatalf("60 MiB through a 32 MiB arena with MinIO down, and nothing spilled:\n%s", d.Logs())
	}
	d.Kill9()

	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.Start()
	c = d.Client()
	for _, req := range saved {
		if err := daemontest.WaitStep(t, c, req.Step, 0); err != nil {
			t.Fatalf("step %d after the outage and the crash: %v\n%s", req.Step, err, d.Logs())
		}
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: req.Step})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, req)
	}
	daemontest.WaitUntil(t, "the spill folder to empty", func() bool { return spilled(spill) == 0 })
	srv.CheckNoUploads(t, bucket)
}

// spilled counts the saves' files in a spill folder (not its lock).
func spilled(dir string) int {
	des, _ := os.ReadDir(dir)
	n := 0
	for _, de := range des {
		if de.Name() != ".lock" {
			n++
		}
	}
	return n
}
