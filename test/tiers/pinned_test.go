package tiers

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/test/daemontest"
)

// forger is a peer (an attacker's process with a certificate of the
// job's CA) that keeps the replicas it is sent and, in their place,
// lists and serves a forgery of its own: a whole, self-consistent shard
// of the same target (its chunks verify), so nothing but the original's
// hash can tell it apart. claim: it says the forgery is the original.
type forger struct {
	quietPeer
	t     *testing.T
	claim bool
	mu    sync.Mutex
	held  map[checkpoint.Target]*checkpoint.Manifest
	data  map[checkpoint.Target][]byte
}

func (f *forger) AcceptReplica(want checkpoint.Target, _, _ []byte, _ bool) error {
	m, data := forged(f.t, want, 0x66)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.held[want], f.data[want] = m, data
	return nil
}
func (f *forger) Inventory(job string) ([]tiers.HeldShard, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []tiers.HeldShard
	for t, m := range f.held {
		if t.Job == job {
			out = append(out, tiers.HeldShard{Step: t.Step, Rank: t.Rank, WorldSize: t.WorldSize, Attempt: t.Attempt,
				MemoryOnly: true, Created: m.Created, ManifestHash: m.Hash(), Original: f.claim})
		}
	}
	return out, nil
}
func (f *forger) Replica(job string, step int64, rank int, _ string) ([]byte, []byte, bool, func(), error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for t, m := range f.held {
		if t.Job == job && t.Step == step && t.Rank == rank {
			b, err := m.Encode()
			return b, f.data[t], false, func() {}, err
		}
	}
	return nil, nil, false, nil, checkpoint.ErrStepNotFound
}

// A step kept in memory only has no commit record to pin its copies, so
// they are pinned to the original's, as its sidecar lists it: a holder
// of a rank's replica that serves a forgery in its place (listed in its
// inventory, every chunk consistent) is passed over while the original
// is held, and one that also claims to hold the original makes the rank
// contested, so the step is not restored from memory at all. Three
// sidecars, sorted: the restorer, the forger (whose copy a restore would
// read first) and the saver.
func TestMemoryOnlyCopyPinnedToTheOriginal(t *testing.T) {
	for _, claim := range []bool{false, true} {
		name := "forged replica"
		if claim {
			name = "forged original"
		}
		t.Run(name, func(t *testing.T) { pinnedCase(t, claim) })
	}
}

func pinnedCase(t *testing.T, claim bool) {
	store := t.TempDir()
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	slices.Sort(addrs)
	restorer, forgerAddr, saver := addrs[0], addrs[1], addrs[2]
	if h := peers.Holders(addrs, saver, 0, 1); !slices.Equal(h, []string{forgerAddr}) {
		t.Fatalf("rank 0's replicas go to %v", h)
	}
	sidecar := func(addr string) *daemontest.Daemon {
		return daemontest.Start(t, store, append([]string{"--hot-bytes", "64MiB", "--replicas", "1", "--persist-every", "100",
			"--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addr}, c.args()...)...)
	}
	f := &forger{t: t, claim: claim, held: map[checkpoint.Target]*checkpoint.Manifest{}, data: map[checkpoint.Target][]byte{}}
	fakePeer(t, c, addrs, forgerAddr, 1, f)
	ds := []*daemontest.Daemon{sidecar(restorer), sidecar(saver)}
	want := daemontest.Shard(1, 0, 1)
	if err := daemontest.Save(t, ds[1].Client(), want).Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	daemontest.WaitUntil(t, "the forger got its replica", func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.held) == 1
	})
	said := "differ from their rank's original" // the forgery passed over
	if claim {
		said = "differing copies" // the rank contested
	}
	got, err := restoreAnswered(t, ds[0], said)
	if claim {
		if err == nil {
			t.Fatalf("a rank two sidecars claim the original of was restored (tier %s)", got.Tier)
		}
		t.Logf("answer: %v", err)
	} else {
		if err != nil {
			t.Fatalf("restore beside a forged replica: %v\n%s", err, ds[0].Logs())
		}
		daemontest.CheckShard(t, got, want)
		if got.Tier != "peer" {
			t.Fatalf("restored from %q, not the original at its peer:\n%s", got.Tier, ds[0].Logs())
		}
	}
	// The sidecars are alive and the saver's own copy restores.
	back, err := ds[1].Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, back, want)
}

// restoreAnswered restores step 1 through d until its log says why the
// restore went as it did (said): on a loaded machine a peer's first
// answer (a TLS handshake away) can miss the inventory's deadline, and
// the restore then sees fewer holders than there are; the daemon says so,
// and the restore is made again. Its log arrives through a pipe, a moment
// after the answer: it is waited for.
func restoreAnswered(t *testing.T, d *daemontest.Daemon, said string) (*ckptd.Shard, error) {
	t.Helper()
	const missed = "some peers did not say what they hold"
	var (
		got *ckptd.Shard
		err error
	)
	daemontest.WaitUntil(t, "a restore whose log says "+said, func() bool {
		wasSaid, wasMissed := strings.Count(d.Logs(), said), strings.Count(d.Logs(), missed)
		got, err = d.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			switch logs := d.Logs(); {
			case strings.Count(logs, said) > wasSaid:
				return true
			case strings.Count(logs, missed) > wasMissed:
				return false
			}
		}
		return false
	})
	return got, err
}
