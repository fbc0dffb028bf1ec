package lifecycle

import (
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// A daemon killed with a save journaled (its arena is kept) but none
// being copied leaves nothing a client may still be writing: the next
// daemon drains the journaled save and its first new save does not wait
// out --crash-fence (an hour here; --staging-wait would fail it after
// 30s, as every save did before the arena recorded its writers).
func TestNoFenceWithoutOpenLeases(t *testing.T) {
	d := daemontest.Start(t, "", "--crash-fence", "1h", "--staging-wait", "30s", "--debug-drain-delay", "1h")
	journaled := daemontest.Shard(1, 0, 1)
	daemontest.Save(t, d.Client(), journaled)
	d.Kill9()
	d.Start("--debug-drain-delay", "0s")
	c := d.Client()
	req := daemontest.Shard(2, 0, 1)
	daemontest.SaveAndWait(t, c, req)
	for _, want := range []*ckptd.SaveRequest{journaled, req} {
		if err := daemontest.WaitStep(t, c, want.Step, 0); err != nil {
			t.Fatal(err)
		}
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: want.Step})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, want)
	}
}
