package s3

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// With MinIO down, a trainer saving 60 MiB through a 32 MiB arena is not
// refused: saves waiting to drain move to --spill-dir. The daemon is then
// killed with saves in the arena and in the spill folder; once MinIO and
// the daemon are back, every acknowledged save commits, byte for byte,
// and the spill folder empties.
//
// CKPTD_OUTAGE_DURATION makes the outage that long, with a save every 5 s
// (make outage: 2 minutes, 24 saves, 144 MiB); without it, 10 saves at
// once.
func TestS3SpillDuringOutage(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	spill := filepath.Join(t.TempDir(), "spill")
	d := daemontest.StartEnv(t, store, srv.Env(), "--staging-bytes", "32MiB", "--spill-dir", spill, "--staging-wait", "1m")
	c := d.Client()
	srv.Kill()
	saves, every := outage(t)
	var saved []*ckptd.SaveRequest
	for step := int64(1); step <= saves; step++ { // 6 MiB each
		req := daemontest.Shard(step, 0, 1)
		if _, err := c.Save(daemontest.Ctx(t), req); err != nil {
			t.Fatalf("save of step %d with MinIO down: %v\n%s", step, err, d.Logs())
		}
		saved = append(saved, req)
		time.Sleep(every)
	}
	if daemontest.Spilled(spill) == 0 {
		t.Fatalf("%d MiB through a 32 MiB arena with MinIO down, and nothing spilled:\n%s", 6*saves, d.Logs())
	}
	t.Logf("%d saves acknowledged with MinIO down; %d files (a save and its journal entry each) in the spill folder when the daemon is killed", saves, daemontest.Spilled(spill))
	d.Kill9()

	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.Start()
	c = d.Client()
	daemontest.CommittedAsSaved(t, d, c, saved) // after the outage and the crash
	daemontest.WaitUntil(t, "the spill folder to empty", func() bool { return daemontest.Spilled(spill) == 0 })
	srv.CheckNoUploads(t, bucket)
}

// outage is how many saves the outage test makes, and the pause after
// each: CKPTD_OUTAGE_DURATION's worth of a save every 5 s, or 10 at once.
func outage(t *testing.T) (saves int64, every time.Duration) {
	v := os.Getenv("CKPTD_OUTAGE_DURATION")
	if v == "" {
		return 10, 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 5*time.Second {
		t.Fatalf("CKPTD_OUTAGE_DURATION=%q: want a duration of 5s or more", v)
	}
	return int64(d / (5 * time.Second)), 5 * time.Second
}
