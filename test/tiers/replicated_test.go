package tiers

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// metric reads one sample of /metrics at addr ("" when absent).
func metric(t *testing.T, addr, sample string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(body)) {
		if rest, ok := strings.CutPrefix(line, sample+" "); ok {
			return strings.TrimSpace(rest)
		}
	}
	return ""
}

// A save kept in memory that reached no peer (its only peer is down)
// ends hot, and says so where the trainer looks: Wait's error matches
// ErrNotReplicated, and ckptd_replication_failures_total counts it. A
// persisted step is not concerned.
func TestNotReplicatedSaid(t *testing.T) {
	me, dead, metrics := daemontest.ClosedAddr(t), daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)
	d := daemontest.Start(t, "", "--hot-bytes", "64MiB", "--persist-every", "2", "--peers", me+","+dead, "--peer-listen", me,
		"--peer-insecure", "--metrics-addr", metrics, "--shutdown-grace", "1s")
	c := d.Client()
	h := daemontest.Save(t, c, daemontest.Shard(1, 0, 1))
	err := h.Wait(daemontest.Ctx(t))
	if !errors.Is(err, ckptd.ErrNotReplicated) || !strings.Contains(err.Error(), dead) {
		t.Fatalf("a save that reached no peer: %v, want ErrNotReplicated naming peer %s", err, dead)
	}
	if st, err := h.Status(daemontest.Ctx(t)); err != nil || st != pb.SaveState_SAVE_STATE_HOT {
		t.Fatalf("its state: %s %v", st, err)
	}
	if got := metric(t, metrics, "ckptd_replication_failures_total"); got != "1" {
		t.Fatalf("ckptd_replication_failures_total %q, want 1", got)
	}
	if err := daemontest.Save(t, c, daemontest.Shard(2, 0, 1)).Wait(daemontest.Ctx(t)); err != nil {
		t.Fatalf("a persisted step: %v", err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(1, 0, 1))
}
