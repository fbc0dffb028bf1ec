package test

import (
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/peers/peertest"
)

// Three sidecars of one job keep replicas of each other's shards (mutual
// TLS): with the node that saved a shard gone and the store's server
// killed, a trainer restarted on another node still loads it from a peer.
// A sidecar without TLS and without --peer-insecure does not start.
func TestPeerReplicas(t *testing.T) {
	srv, _, store := s3Store(t)
	dir := t.TempDir()
	ca := peertest.NewCA(t, dir, "ca")
	cert, key := ca.Leaf(t, dir, "node")
	addrs := []string{closedAddr(t), closedAddr(t), closedAddr(t)}
	var ds []*daemon
	for _, addr := range addrs {
		ds = append(ds, startDaemonEnv(t, store, srv.Env(), "--hot-bytes", "64MiB", "--s3-retry-deadline", "1s",
			"--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addr,
			"--peer-cert", cert, "--peer-key", key, "--peer-ca", ca.File))
	}
	want := map[int]*ckptd.SaveRequest{}
	for rank := range 3 { // rank r saved through sidecar r
		want[rank] = shard(8, rank, 3)
		if _, err := ds[rank].client().Save(ctxT(t), want[rank]); err != nil {
			t.Fatal(err)
		}
	}
	for rank := range 3 {
		if err := waitStep(t, ds[rank].client(), 8, rank); err != nil {
			t.Fatal(err)
		}
	}
	waitLog(t, ds, "replicated to peers", 3)
	ds[0].kill9() // the node of rank 0 is lost
	srv.Kill()    // and storage does not answer
	for _, d := range ds[1:] {
		got, err := d.client().Load(ctxT(t), &ckptd.LoadRequest{Step: 8, Rank: 0})
		if err != nil {
			t.Fatalf("rank 0 from a peer, with its node and storage gone: %v\n%s", err, d.logs())
		}
		checkShard(t, got, want[0])
	}

	_, stderr, err := ckptdCLI(t, "serve", "--storage", t.TempDir(), "--hot-bytes", "1MiB", "--peers", addrs[0]+","+addrs[1], "--peer-listen", addrs[0])
	if err == nil || !strings.Contains(stderr, "--peer-insecure") {
		t.Fatalf("peers without TLS: %v\n%s", err, stderr)
	}
}

// waitLog waits until the daemons' logs hold line n times in all.
func waitLog(t *testing.T, ds []*daemon, line string, n int) {
	t.Helper()
	waitUntil(t, "the daemons log "+line, func() bool {
		count := 0
		for _, d := range ds {
			count += strings.Count(d.logs(), line)
		}
		return count >= n
	})
}

// waitUntil polls cond for up to 30s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s", what)
		}
	}
}
