package test

import (
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
)

// With --hot-bytes, the newest steps restore from the daemon's memory:
// with the store's server killed, a trainer restarted on the node still
// loads its step (and the newest for latest); `ckptd status` shows the
// tier.
func TestHotTierRestoresWithoutStorage(t *testing.T) {
	srv, _, store := s3Store(t)
	d := startDaemonEnv(t, store, srv.Env(), "--hot-bytes", "64MiB", "--s3-retry-deadline", "1s", "--shutdown-grace", "1s")
	c := d.client()
	want := map[int64]*ckptd.SaveRequest{}
	for _, step := range []int64{5, 6} {
		want[step] = shard(step, 0, 1)
		if _, err := c.Save(ctxT(t), want[step]); err != nil {
			t.Fatal(err)
		}
		if err := waitStep(t, c, step, 0); err != nil {
			t.Fatal(err)
		}
	}
	// A shard enters the hot tier just after its step commits.
	waitUntil(t, "ckptd status shows both shards hot", func() bool {
		out, _, err := ckptdCLI(t, "status", "--socket", d.socket)
		return err == nil && strings.Contains(out, "2 rank shards")
	})
	srv.Kill()
	c2 := d.client() // the trainer, restarted
	got, err := c2.Load(ctxT(t), &ckptd.LoadRequest{Step: 5})
	if err != nil {
		t.Fatalf("load of a hot step with storage down: %v\n%s", err, d.logs())
	}
	checkShard(t, got, want[5])
	got, err = c2.Load(ctxT(t), &ckptd.LoadRequest{Latest: true})
	if err != nil {
		t.Fatalf("load latest with storage down: %v", err)
	}
	checkShard(t, got, want[6])
	if _, err := c2.Load(ctxT(t), &ckptd.LoadRequest{Step: 4}); err == nil {
		t.Fatal("a step never saved loaded with storage down")
	}
}
