package tiers

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/internal/peers/peertest"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// Four sidecars play four nodes of one job (2 ranks each, one shared
// store, --replicas 1, --persist-every 5, the peers listed in a file): step 5 is persisted, steps 6
// and 7 live in memory only, and restore from the hot tier (a restarted
// trainer), from peers (a lost node's ranks, on a replacement sidecar),
// and, with both copies of a rank lost, fall back to step 5, saying so.
// Peers refuse plaintext and certificates of another CA.
func TestTiersFourNodes(t *testing.T) {
	store := filepath.Join(t.TempDir(), "store")
	dir := t.TempDir()
	ca := peertest.NewCA(t, dir, "ca")
	cert, key := ca.Leaf(t, dir, "node")
	const nodes, world = 4, 8
	addrs := make([]string, nodes)
	for i := range addrs {
		addrs[i] = daemontest.ClosedAddr(t)
	}
	peerFile := filepath.Join(dir, "peers") // as a launcher would write it; each sidecar finds itself by its port
	if err := os.WriteFile(peerFile, []byte("# the job's sidecars\n"+strings.Join(addrs, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sidecar := func(node int) *daemontest.Daemon {
		return daemontest.Start(t, store, "--hot-bytes", "96MiB", "--persist-every", "5", "--replicas", "1",
			"--shutdown-grace", "1s", "--peers-file", peerFile, "--peer-listen", addrs[node],
			"--peer-cert", cert, "--peer-key", key, "--peer-ca", ca.File)
	}
	ds := make([]*daemontest.Daemon, nodes)
	for n := range ds {
		ds[n] = sidecar(n)
	}
	for _, step := range []int64{5, 6, 7} {
		saveStep(t, ds, step, world)
	}
	if _, err := os.Stat(filepath.Join(store, "e2e/steps/000000000005/COMMIT.json")); err != nil {
		t.Fatalf("step 5 (persisted) not committed: %v", err)
	}
	for _, step := range []string{"000000000006", "000000000007"} {
		if _, err := os.Stat(filepath.Join(store, "e2e/steps", step)); !os.IsNotExist(err) {
			t.Fatalf("step %s, kept in memory only, reached the store: %v", step, err)
		}
	}

	out, stderr, err := daemontest.CLI(t, "list", "--tiers", "--socket", ds[0].Socket)
	if err != nil || !strings.Contains(out, "\n5     8      run1     storage    \n") || // evicted from memory: 2 hot steps
		!strings.Contains(out, "\n7     8      run1     hot,peers  memory only\n") {
		t.Fatalf("list --tiers: %v\n%s%s", err, out, stderr)
	}

	// A trainer restarted on its node: the hot tier. Step 7 is nowhere in
	// the store, so bytes that match were read from no storage.
	loadLatest(t, ds[0], 1, 7, "hot", 0)

	// Node 1 lost, arena and all; its replacement serves ranks 2 and 3
	// from the peers that hold their replicas.
	ds[1].Kill9()
	os.RemoveAll(ds[1].Arena)
	ds[1] = sidecar(1)
	loadLatest(t, ds[1], 2, 7, "peer", 0)
	loadLatest(t, ds[1], 3, 7, "peer", 0)
	if strings.Contains(ds[1].Logs(), "raw data path failed") { // shards travel off gRPC, with the same mutual TLS
		t.Errorf("the raw data path failed:\n%s", ds[1].Logs())
	}

	// Rank 0's node and the one holding its replica lost: steps 6 and 7
	// are no longer whole anywhere; latest is step 5, and says what it
	// skipped.
	holder := peers.Holders(addrs, addrs[0], 0, 1)[0]
	lost := []int{0, slices.Index(addrs, holder)}
	for _, n := range lost {
		ds[n].Kill9()
	}
	survivor := ds[slices.IndexFunc([]int{0, 1, 2, 3}, func(n int) bool { return !slices.Contains(lost, n) })]
	loadLatest(t, survivor, 0, 5, "", 7)
	if !strings.Contains(survivor.Logs(), "restoring the last persisted step") {
		t.Errorf("the fallback is not logged:\n%s", survivor.Logs())
	}
	out, _, _ = daemontest.CLI(t, "list", "--tiers", "--socket", survivor.Socket)
	if !strings.Contains(out, "ranks held: not restorable") {
		t.Errorf("list --tiers with rank 0 lost:\n%s", out)
	}
	if _, err := survivor.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 7, Rank: 0}); err == nil ||
		!strings.Contains(err.Error(), "memory only") {
		t.Errorf("step 7 with rank 0 lost: %v", err)
	}

	// Plaintext, and a certificate of another CA, are refused.
	other := peertest.NewCA(t, dir, "other")
	ocert, okey := other.Leaf(t, dir, "intruder")
	for name, tlsOpts := range map[string]peers.TLS{
		"plaintext": {Insecure: true},
		"other CA":  {CertFile: ocert, KeyFile: okey, CAFile: ca.File},
	} {
		_, creds, err := tlsOpts.Credentials()
		if err != nil {
			t.Fatal(err)
		}
		c := peers.NewClient([]string{addrs[2], "127.0.0.1:1"}, "127.0.0.1:1", 1, creds, nil)
		held, err := c.Inventory(context.Background(), "e2e")
		c.Close()
		if err == nil || len(held) != 0 {
			t.Errorf("%s: a peer answered: %v %v", name, held, err)
		}
	}
}

// saveStep saves every rank of step through its node's sidecar (rank r on
// node r/2) and waits for each save to end: committed on a persisted step,
// replicated on the others.
func saveStep(t *testing.T, ds []*daemontest.Daemon, step int64, world int) {
	t.Helper()
	want := pb.SaveState_SAVE_STATE_REPLICATED
	if step%5 == 0 {
		want = pb.SaveState_SAVE_STATE_COMMITTED
	}
	handles := make([]*ckptd.SaveHandle, world)
	for rank := range world {
		h, err := ds[rank/2].Client().Save(daemontest.Ctx(t), daemontest.Shard(step, rank, world))
		if err != nil {
			t.Fatal(err)
		}
		handles[rank] = h
	}
	for rank, h := range handles {
		if err := h.Wait(daemontest.Ctx(t)); err != nil {
			t.Fatalf("step %d rank %d: %v\n%s", step, rank, err, ds[rank/2].Logs())
		}
		if st, err := h.Status(daemontest.Ctx(t)); err != nil || st != want {
			t.Fatalf("step %d rank %d: %s (%v), want %s", step, rank, st, err, want)
		}
	}
}

// loadLatest loads rank's latest through d and checks the step, its bytes,
// the tier it came from ("" for any) and the step it says it skipped.
func loadLatest(t *testing.T, d *daemontest.Daemon, rank int, step int64, tier string, skipped int64) {
	t.Helper()
	got, err := d.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: rank})
	if err != nil {
		t.Fatalf("latest of rank %d: %v\n%s", rank, err, d.Logs())
	}
	daemontest.CheckShard(t, got, daemontest.Shard(step, rank, 8))
	if tier != "" && got.Tier != tier || got.SkippedStep != skipped {
		t.Fatalf("latest of rank %d: step %d from %q, skipped %d; want from %q, skipped %d", rank, got.Step, got.Tier, got.SkippedStep, tier, skipped)
	}
}

// With --persist-interval, sidecars decide from their own clocks: here
// node 1 (a 1h interval) keeps step 3 in memory while node 0 (a few
// seconds) persists it, tells node 1, and node 1 persists its rank from
// memory, so that the step commits.
func TestPersistIntervalConverges(t *testing.T) {
	// Steps 1 and 2 are saved together, so that node 0 decides step 2
	// well within its interval of step 1 however busy the machine is.
	interval := testtime.Scale(5 * time.Second)
	store := filepath.Join(t.TempDir(), "store")
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	var ds []*daemontest.Daemon
	for n, interval := range []string{interval.String(), "1h"} {
		ds = append(ds, daemontest.Start(t, store, "--hot-bytes", "64MiB", "--persist-interval", interval, "--shutdown-grace", "1s",
			"--peers", strings.Join(addrs, ","), "--peer-listen", addrs[n], "--peer-insecure"))
	}
	save := func(step int64, rank int) *ckptd.SaveHandle {
		h, err := ds[rank].Client().Save(daemontest.Ctx(t), daemontest.Shard(step, rank, 2))
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	wait := func(h *ckptd.SaveHandle, want pb.SaveState) {
		t.Helper()
		if err := h.Wait(daemontest.Ctx(t)); err != nil {
			t.Fatal(err)
		}
		daemontest.WaitUntil(t, "a save reaches "+want.String(), func() bool {
			st, err := h.Status(daemontest.Ctx(t))
			return err == nil && st == want
		})
	}
	committed := func(step string) bool {
		_, err := os.Stat(filepath.Join(store, "e2e/steps", step, "COMMIT.json"))
		return err == nil
	}
	// Step 1: the first since the daemons started, persisted by both;
	// step 2, right after: in memory on both.
	h10, h11, h20, h21 := save(1, 0), save(1, 1), save(2, 0), save(2, 1)
	wait(h10, pb.SaveState_SAVE_STATE_COMMITTED)
	wait(h11, pb.SaveState_SAVE_STATE_COMMITTED)
	wait(h20, pb.SaveState_SAVE_STATE_REPLICATED)
	wait(h21, pb.SaveState_SAVE_STATE_REPLICATED)
	if committed("000000000002") {
		t.Fatal("step 2, within both intervals, reached storage")
	}
	time.Sleep(interval + 100*time.Millisecond) // node 0's interval since step 1 passes
	// Step 3: node 1 keeps its rank in memory (1h), node 0 persists
	// (its interval passed) and tells it.
	h1 := save(3, 1)
	wait(h1, pb.SaveState_SAVE_STATE_REPLICATED)
	h0 := save(3, 0)
	wait(h0, pb.SaveState_SAVE_STATE_COMMITTED)
	wait(h1, pb.SaveState_SAVE_STATE_COMMITTED)
	if !committed("000000000003") || !strings.Contains(ds[1].Logs(), "persisted this sidecar's rank of it from memory") {
		t.Fatalf("step 3 did not converge:\n%s", ds[1].Logs())
	}
	got, err := ds[1].Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: 1})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(3, 1, 2))
}
