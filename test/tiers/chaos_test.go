package tiers

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// The chaos test: a job of 6 ranks on 3 nodes' sidecars (--persist-every
// 3, --replicas 1, a hot tier too small for every step the ranks hold,
// so room is made and some saves are persisted instead), whose ranks save
// at their own pace, drifting up to 3 steps apart, while nodes are lost
// (killed, memory and arena gone, a fresh sidecar in their place). After
// each loss the job restarts: every rank loads latest, and they must all
// get the same step, at least the newest step every rank was told is
// replicated or committed, with the bytes it saved; then they go on from
// there under a new attempt. A node is lost only once every rank was told
// a newer step is replicated since the last loss (each rank then has a
// copy on a live node).
//
// CKPTD_CHAOS_DURATION runs it that long (make chaos: 10 minutes);
// without it, until 3 nodes were lost and 200 saves made (about a
// minute).
func TestChaos(t *testing.T) {
	const (
		nodes, perNode = 3, 2
		world          = nodes * perNode
		maxDrift       = 3
	)
	duration, losses, minSaves := time.Duration(0), 3, 200
	if d := os.Getenv("CKPTD_CHAOS_DURATION"); d != "" {
		var err error
		if duration, err = time.ParseDuration(d); err != nil {
			t.Fatalf("CKPTD_CHAOS_DURATION=%q: %v", d, err)
		}
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("CKPTD_CHAOS_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (CKPTD_CHAOS_SEED replays it)", seed)
	rng := rand.New(rand.NewPCG(seed, 26))

	store := filepath.Join(t.TempDir(), "store")
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	addrs := make([]string, nodes)
	for i := range addrs {
		addrs[i] = daemontest.ClosedAddr(t)
	}
	sidecar := func(n int) *daemontest.Daemon {
		return daemontest.Start(t, store, append([]string{"--hot-bytes", "1MiB", "--persist-every", "3", "--replicas", "1",
			"--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addrs[n]}, c.args()...)...)
	}
	ds := make([]*daemontest.Daemon, nodes)
	clients := make([]*ckptd.Client, nodes)
	for n := range ds {
		ds[n] = sidecar(n)
		clients[n] = ds[n].Client()
	}

	attempt := "chaos-0"
	progress := make([]int64, world)      // each rank's last step saved
	told := make([]map[int64]bool, world) // the steps each rank was told are replicated or committed
	for r := range told {
		told[r] = map[int64]bool{}
	}
	// safe is the newest step every rank was told is replicated or
	// committed (0: none).
	safe := func() int64 {
		for s := slices.Min(progress); s > 0; s-- {
			all := true
			for r := range world {
				all = all && told[r][s]
			}
			if all {
				return s
			}
		}
		return 0
	}
	pending := map[*ckptd.SaveHandle]int{} // persisted saves not committed yet, by rank
	start, saves, lost, restoredAt := time.Now(), 0, 0, int64(0)
	for duration > 0 && time.Since(start) < duration || duration == 0 && (lost < losses || saves < minSaves) {
		// A rank not too far ahead of the slowest saves its next step.
		slowest := slices.Min(progress)
		var ready []int
		for r := range world {
			if progress[r] < slowest+maxDrift {
				ready = append(ready, r)
			}
		}
		r := ready[rng.IntN(len(ready))]
		step := progress[r] + 1
		node := r / perNode
		h, err := clients[node].Save(daemontest.Ctx(t), chaosShard(step, r, world, attempt))
		if err != nil {
			t.Fatalf("save step %d rank %d: %v\n%s", step, r, err, ds[node].Logs())
		}
		// A persisted step commits once every rank saved it: a trainer
		// goes on once it is durable, and learns of the commit later.
		var st pb.SaveState
		daemontest.WaitUntil(t, fmt.Sprintf("step %d rank %d settles", step, r), func() bool {
			st, err = h.Status(daemontest.Ctx(t))
			return err != nil || st != pb.SaveState_SAVE_STATE_STAGED && st != pb.SaveState_SAVE_STATE_DRAINING
		})
		if err != nil || st == pb.SaveState_SAVE_STATE_FAILED {
			t.Fatalf("step %d rank %d: %s %v\n%s", step, r, st, err, ds[node].Logs())
		}
		pending[h] = r
		progress[r], saves = step, saves+1

		for h, r := range pending { // what the trainers were told since
			st, err := h.Status(daemontest.Ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			if st != pb.SaveState_SAVE_STATE_DURABLE {
				told[r][h.Step()] = st == pb.SaveState_SAVE_STATE_REPLICATED || st == pb.SaveState_SAVE_STATE_COMMITTED
				delete(pending, h)
			}
		}
		if w := safe(); w <= restoredAt || rng.IntN(8) != 0 {
			continue
		}
		// Lose a node, then restart the job.
		w := safe()
		n := rng.IntN(nodes)
		t.Logf("%s: losing node %d after %d saves; every rank was told step %d is replicated; progress %v",
			time.Since(start).Round(time.Second), n, saves, w, progress)
		ds[n].Kill9()
		os.RemoveAll(ds[n].Arena)
		ds[n] = sidecar(n)
		clients[n] = ds[n].Client()
		got := int64(-1)
		for r := range world {
			sh, err := clients[r/perNode].Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: r})
			if err != nil {
				t.Fatalf("after losing node %d (every rank told step %d is replicated), rank %d's latest: %v\n%s",
					n, w, r, err, ds[r/perNode].Logs())
			}
			if got < 0 {
				got = sh.Step
			}
			if sh.Step != got || sh.Step < w {
				t.Fatalf("after losing node %d, rank %d's latest is step %d (from %s, skipped %d); rank 0's is %d, and every rank was told step %d is replicated",
					n, r, sh.Step, sh.Tier, sh.SkippedStep, got, w)
			}
			want := chaosShard(sh.Step, r, world, "")
			if !bytes.Equal(sh.Tensors[0].Data, want.Tensors[0].Data) {
				t.Fatalf("rank %d's step %d restored other bytes", r, sh.Step)
			}
		}
		t.Logf("every rank restored step %d", got)
		lost, restoredAt = lost+1, got
		attempt = fmt.Sprintf("chaos-%d", lost)
		for r := range world {
			progress[r] = got
			told[r] = map[int64]bool{got: true}
		}
		clear(pending)
	}
	t.Logf("%d saves, %d nodes lost, in %s", saves, lost, time.Since(start).Round(time.Second))
}

// chaosShard is rank's shard of step: 64 KiB of bytes of its own.
func chaosShard(step int64, rank, world int, attempt string) *ckptd.SaveRequest {
	data := make([]byte, 64<<10)
	r := rand.New(rand.NewPCG(uint64(step), uint64(rank)))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	return &ckptd.SaveRequest{Step: step, Rank: rank, WorldSize: world, Attempt: attempt,
		Tensors: []ckptd.Tensor{{Name: "w", DType: "U8", Shape: []int64{int64(len(data))}, Data: data}}}
}
