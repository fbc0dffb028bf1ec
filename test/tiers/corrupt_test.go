package tiers

import (
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/test/daemontest"
)

// evilHolder is a peer (an attacker's process with a certificate of the
// job's CA) that keeps the replicas it is sent and serves them with one
// byte of their data changed, claiming their steps committed.
type evilHolder struct {
	quietPeer
	mu   sync.Mutex
	held map[checkpoint.Target][2][]byte // manifest, data
}

func (e *evilHolder) AcceptReplica(want checkpoint.Target, manifest, data []byte, _ bool) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	bad := slices.Clone(data)
	bad[len(bad)/2] ^= 0xff
	e.held[want] = [2][]byte{manifest, bad}
	return nil
}
func (e *evilHolder) Inventory(string) ([]tiers.HeldShard, error) {
	return nil, nil
}

// quietPeer is the part of peers.Local a fake peer does nothing with.
type quietPeer struct{}

func (quietPeer) ReplicaBuffer(_ checkpoint.Target, n int64) ([]byte, error) {
	return make([]byte, n), nil
}
func (quietPeer) ReturnBuffer([]byte)                     {}
func (quietPeer) Holds(checkpoint.Target) bool            { return false }
func (quietPeer) PersistStep(string, int64, string) error { return nil }
func (e *evilHolder) Replica(job string, step int64, rank int, _ string) ([]byte, []byte, bool, func(), error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for t, h := range e.held {
		if t.Job == job && t.Step == step && t.Rank == rank {
			return h[0], h[1], true, func() {}, nil
		}
	}
	return nil, nil, false, nil, checkpoint.ErrStepNotFound
}

// fakePeer serves local (an attacker's code) as the peer at self of
// addrs, with the job's certificates c, until the test ends.
func fakePeer(t *testing.T, c certs, addrs []string, self string, replicas int, local peers.Local) {
	t.Helper()
	server, client, err := peers.TLS{CertFile: c.cert, KeyFile: c.key, CAFile: c.ca}.Credentials()
	if err != nil {
		t.Fatal(err)
	}
	members := peers.NewClient(addrs, self, replicas, client, nil)
	t.Cleanup(members.Close)
	_, stop, err := peers.Listen(self, server, peers.NewServer(local, 64<<20).Members(members))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
}

// A holder serving a corrupt copy (here a peer that changes one byte of
// what it is sent) does not fail a restore that another holder can
// serve: the restoring sidecar reads the next holder's copy. Four
// sidecars, sorted: the saver, the corrupt holder and a good holder of
// rank 0's replicas (--replicas 2), and the restorer, which asks the
// corrupt one first.
func TestCorruptReplicaFallsBack(t *testing.T) {
	store := t.TempDir()
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t), daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	slices.Sort(addrs)
	saver, evilAddr, good, restorer := addrs[0], addrs[1], addrs[2], addrs[3]
	if h := peers.Holders(addrs, saver, 0, 2); !slices.Equal(h, []string{evilAddr, good}) {
		t.Fatalf("rank 0's replicas go to %v", h)
	}
	sidecar := func(addr string) *daemontest.Daemon {
		return daemontest.Start(t, store, append([]string{"--hot-bytes", "64MiB", "--replicas", "2", "--shutdown-grace", "1s",
			"--peers", addrs[0] + "," + addrs[1] + "," + addrs[2] + "," + addrs[3], "--peer-listen", addr}, c.args()...)...)
	}
	evil := &evilHolder{held: map[checkpoint.Target][2][]byte{}}
	fakePeer(t, c, addrs, evilAddr, 2, evil)
	ds := []*daemontest.Daemon{sidecar(saver), sidecar(good), sidecar(restorer)}
	want := daemontest.Shard(1, 0, 1)
	if err := daemontest.Save(t, ds[0].Client(), want).Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	daemontest.WaitUntil(t, "the corrupt holder got its replica", func() bool {
		evil.mu.Lock()
		defer evil.mu.Unlock()
		return len(evil.held) == 1
	})
	daemontest.WaitLog(t, ds[:1], "replicated to peers", 1)
	ds[0].Kill9() // the saver's node is lost: only peers hold rank 0 in memory
	got, err := ds[2].Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if err != nil {
		t.Fatalf("a restore with one holder's copy corrupt: %v\n%s", err, ds[2].Logs())
	}
	daemontest.CheckShard(t, got, want)
	if got.Tier != "peer" || !strings.Contains(ds[2].Logs(), "reading the next holder's") {
		t.Fatalf("restored from %q, not after falling back from the corrupt copy:\n%s", got.Tier, ds[2].Logs())
	}
}
