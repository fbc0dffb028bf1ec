package tiers

import (
	"bytes"
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

// The Go client restores from the hot tier in place: it reads the hot
// copy where it lies in the daemon's hot file (mapped read-only), whole
// or some tensors, bit for bit, and the daemon counts those bytes as
// read in place rather than copied into the arena.
func TestGoClientRestoresInPlace(t *testing.T) {
	metrics := daemontest.ClosedAddr(t)
	d := daemontest.Start(t, "", "--hot-bytes", "64MiB", "--metrics-addr", metrics, "--shutdown-grace", "1s")
	c := d.Client()
	want := daemontest.Shard(3, 0, 1)
	if err := daemontest.Save(t, c, want).Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	daemontest.WaitUntil(t, "ckptd status shows the shard hot", func() bool {
		out, _, err := daemontest.CLI(t, "status", "--socket", d.Socket)
		return err == nil && strings.Contains(out, "1 rank shards")
	})
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 3})
	if err != nil {
		t.Fatal(err)
	}
	if got.Tier != "hot" {
		t.Fatalf("restored from %q, want hot", got.Tier)
	}
	daemontest.CheckShard(t, got, want)
	whole := metric(t, metrics, "ckptd_restored_in_place_bytes_total")
	if whole == "" || whole == "0" {
		t.Fatalf("ckptd_restored_in_place_bytes_total %q after a restore from the hot tier", whole)
	}
	part, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 3, Tensors: []string{"optim.exp_avg"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(part.Tensors) != 1 || !bytes.Equal(part.Tensors[0].Data, want.Tensors[1].Data) {
		t.Fatalf("the partial restore in place: %d tensors", len(part.Tensors))
	}
	if after := metric(t, metrics, "ckptd_restored_in_place_bytes_total"); after == whole {
		t.Fatal("the partial restore was not read in place")
	}
}
