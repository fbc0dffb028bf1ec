package tiers

import (
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// With --hot-bytes, the newest steps restore from the daemon's memory:
// with the store's server killed, a trainer restarted on the node still
// loads its step (and the newest for latest); `ckptd status` shows the
// tier.
func TestHotTierRestoresWithoutStorage(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--hot-bytes", "64MiB", "--s3-retry-deadline", "1s", "--shutdown-grace", "1s")
	c := d.Client()
	want := map[int64]*ckptd.SaveRequest{}
	for _, step := range []int64{5, 6} {
		want[step] = daemontest.Shard(step, 0, 1)
		if _, err := c.Save(daemontest.Ctx(t), want[step]); err != nil {
			t.Fatal(err)
		}
		if err := daemontest.WaitStep(t, c, step, 0); err != nil {
			t.Fatal(err)
		}
	}
	// A shard enters the hot tier just after its step commits.
	daemontest.WaitUntil(t, "ckptd status shows both shards hot", func() bool {
		out, _, err := daemontest.CLI(t, "status", "--socket", d.Socket)
		return err == nil && strings.Contains(out, "2 rank shards")
	})
	srv.Kill()
	c2 := d.Client() // the trainer, restarted
	got, err := c2.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 5})
	if err != nil {
		t.Fatalf("load of a hot step with storage down: %v\n%s", err, d.Logs())
	}
	daemontest.CheckShard(t, got, want[5])
	got, err = c2.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true})
	if err != nil {
		t.Fatalf("load latest with storage down: %v", err)
	}
	daemontest.CheckShard(t, got, want[6])
	if _, err := c2.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 4}); err == nil {
		t.Fatal("a step never saved loaded with storage down")
	}
}
