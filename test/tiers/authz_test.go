package tiers

import (
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/test/daemontest"
)

// A peer is served only as the entry of the peer list its certificate
// names, and sends only the replicas of the ranks that entry sends to
// this sidecar, of shards it does not hold: the job's sidecars are
// 127.0.0.1 (the victim), 127.0.0.2 (the attacker's certificate) and
// 127.0.0.3, so from the attacker's entry the victim keeps rank 2's
// replicas (mod 3), never rank 0's. A certificate of the job's CA naming
// no entry gets nothing at all.
func TestPeerAuthorisedPerShard(t *testing.T) {
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	v := daemontest.ClosedAddr(t)
	evilAddr, third := "127.0.0.2:7465", "127.0.0.3:7465"
	list := []string{v, evilAddr, third}
	vic := startVictimIn(t, list, v, evilAddr, c)
	// Each sends to the victim whatever the rank (a list of the two).
	evil := vic.peer(t, c.node(t, "node2", "127.0.0.2"), []string{v, evilAddr}, evilAddr)
	stranger := vic.peer(t, c.node(t, "node9", "127.0.0.9"), []string{v, "127.0.0.9:7465"}, "127.0.0.9:7465")
	ctx := daemontest.Ctx(t)
	send := func(p *peers.Client, rank int, fill byte) error {
		m, data := forged(t, checkpoint.Target{Job: "e2e", Step: 7, Rank: rank, WorldSize: 6, Attempt: daemontest.Attempt}, fill)
		return p.Replicate(ctx, m, data, false, true)
	}

	if err := send(evil, 0, 1); err == nil || !strings.Contains(err.Error(), "does not send rank 0's replicas to this sidecar") {
		t.Errorf("a replica of a rank the sender does not send here: %v", err)
	}
	if err := send(evil, 2, 1); err != nil {
		t.Fatalf("a replica of a rank the sender sends here: %v\n%s", err, vic.Logs())
	}
	if err := send(evil, 2, 2); err == nil || !strings.Contains(err.Error(), "held here already") {
		t.Errorf("a replica over one held, with other content: %v", err)
	}
	held, err := evil.Inventory(ctx, "e2e")
	if len(held[v]) != 2 { // the good step's rank 0, and rank 2 of step 7
		t.Errorf("the attacker's entry, a peer, reads the inventory: %v %v", held, err)
	}

	if err := send(stranger, 2, 3); err == nil || !strings.Contains(err.Error(), "none of this sidecar's peers") {
		t.Errorf("a certificate naming no peer sends a replica: %v", err)
	}
	if held, err := stranger.Inventory(ctx, "e2e"); err == nil || len(held) != 0 {
		t.Errorf("a certificate naming no peer reads the inventory: %v %v", held, err)
	}
	if _, _, err := stranger.FetchManifest(ctx, "e2e", 1, 0, daemontest.Attempt, []string{v}); err == nil || !strings.Contains(err.Error(), "none of this sidecar's peers") {
		t.Errorf("a certificate naming no peer reads a shard: %v", err)
	}
	if err := stranger.Persist(ctx, "e2e", 1, daemontest.Attempt); err == nil {
		t.Error("a certificate naming no peer told the sidecar a step is persisted")
	}
	vic.check(t, "replicas of other ranks, and a stranger's calls")
}
