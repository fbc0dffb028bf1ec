package tiers

import (
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// Three sidecars of one job keep replicas of each other's shards (mutual
// TLS): with the node that saved a shard gone and the store's server
// killed, a trainer restarted on another node still loads it from a peer.
// Their certificates are made by docs/tiers.md's recipe.
// A sidecar without TLS and without --peer-insecure does not start.
func TestPeerReplicas(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	var ds []*daemontest.Daemon
	for _, addr := range addrs {
		ds = append(ds, daemontest.StartEnv(t, store, srv.Env(), "--hot-bytes", "64MiB", "--s3-retry-deadline", "1s",
			"--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addr,
			"--peer-cert", c.cert, "--peer-key", c.key, "--peer-ca", c.ca))
	}
	want := map[int]*ckptd.SaveRequest{}
	for rank := range 3 { // rank r saved through sidecar r
		want[rank] = daemontest.Shard(8, rank, 3)
		if _, err := ds[rank].Client().Save(daemontest.Ctx(t), want[rank]); err != nil {
			t.Fatal(err)
		}
	}
	for rank := range 3 {
		if err := daemontest.WaitStep(t, ds[rank].Client(), 8, rank); err != nil {
			t.Fatal(err)
		}
	}
	daemontest.WaitLog(t, ds, "replicated to peers", 3)
	ds[0].Kill9() // the node of rank 0 is lost
	srv.Kill()    // and storage does not answer
	for _, d := range ds[1:] {
		got, err := d.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 8, Rank: 0})
		if err != nil {
			t.Fatalf("rank 0 from a peer, with its node and storage gone: %v\n%s", err, d.Logs())
		}
		daemontest.CheckShard(t, got, want[0])
	}

	_, stderr, err := daemontest.CLI(t, "serve", "--storage", t.TempDir(), "--hot-bytes", "1MiB", "--peers", addrs[0]+","+addrs[1], "--peer-listen", addrs[0])
	if err == nil || !strings.Contains(stderr, "--peer-insecure") {
		t.Fatalf("peers without TLS: %v\n%s", err, stderr)
	}
}
