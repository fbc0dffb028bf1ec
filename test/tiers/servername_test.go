package tiers

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/peers/peertest"
	"github.com/ckptd/ckptd/test/daemontest"
)

// Peers dialled by address (a headless service's pod IPs) with
// certificates that name only a shared name: serve refuses them at start
// unless --peer-server-name gives that name, and with it the sidecars
// replicate to each other and restore a lost node's rank from its peer.
func TestPeerServerName(t *testing.T) {
	store := filepath.Join(t.TempDir(), "store")
	dir := t.TempDir()
	ca := peertest.NewCA(t, dir, "ca")
	cert, key := ca.LeafNamed(t, dir, "node", "ckptd-peer")
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	args := func(n int) []string {
		return []string{"--hot-bytes", "96MiB", "--persist-every", "5", "--replicas", "1", "--shutdown-grace", "1s",
			"--peers", strings.Join(addrs, ","), "--peer-listen", addrs[n], "--peer-cert", cert, "--peer-key", key, "--peer-ca", ca.File}
	}

	refused := daemontest.New(t, "", store, append(daemontest.DefaultArgs, args(0)...)...)
	out, err := daemontest.Command(daemontest.Bin(t), refused.Args...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "does not name 127.0.0.1") || !strings.Contains(string(out), "--peer-") {
		t.Fatalf("serve with a certificate that does not name the dialled address: %v\n%s", err, out)
	}

	ds := make([]*daemontest.Daemon, 2)
	for n := range ds {
		ds[n] = daemontest.Start(t, store, append(args(n), "--peer-server-name", "ckptd-peer")...)
	}
	const world = 4           // ranks 2n, 2n+1 on node n
	saveStep(t, ds, 6, world) // memory only: replicated to the peer or it fails
	ds[1].Kill9()
	ds[1] = daemontest.Start(t, store, append(args(1), "--peer-server-name", "ckptd-peer")...)
	got, err := ds[1].Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: 2})
	if err != nil {
		t.Fatalf("rank 2 after its node's loss: %v\n%s", err, ds[1].Logs())
	}
	if got.Tier != "peer" || got.Step != 6 {
		t.Fatalf("rank 2 after its node's loss: step %d from %q, want 6 from a peer", got.Step, got.Tier)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(6, 2, world))
}
