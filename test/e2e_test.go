package test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/safetensors"
)

// shard builds rank's tensors for step: weights, an optimizer-like state,
// a step counter and an empty tensor, with content unique to (step, rank).
func shard(step int64, rank, world int) *ckptd.SaveRequest {
	r := rand.New(rand.NewPCG(uint64(step), uint64(rank)))
	f32 := func(n int) []byte {
		b := make([]byte, 4*n)
		for i := range n {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
		}
		return b
	}
	return &ckptd.SaveRequest{
		Step: step, Rank: rank, WorldSize: world,
		Metadata: []byte(fmt.Sprintf(`{"loader_pos": %d}`, step*10+int64(rank))),
		Tensors: []ckptd.Tensor{
			{Name: "model.layers.0.weight", DType: "F32", Shape: []int64{1024, 1536}, Data: f32(1024 * 1536)},
			{Name: "optim.exp_avg", DType: "F32", Shape: []int64{300, 7}, Data: f32(2100)},
			{Name: "step", DType: "I64", Shape: []int64{}, Data: binary.LittleEndian.AppendUint64(nil, uint64(step))},
			{Name: "empty", DType: "BF16", Shape: []int64{0}, Data: nil},
		},
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// saveAll saves every rank of each step through c and waits for commits.
func saveAll(t *testing.T, c *ckptd.Client, steps []int64, world int, stream bool) {
	t.Helper()
	ctx := ctxT(t)
	var handles []*ckptd.SaveHandle
	for _, step := range steps {
		for rank := range world {
			save := c.Save
			if stream {
				save = c.SaveStream
			}
			h, err := save(ctx, shard(step, rank, world))
			if err != nil {
				t.Fatalf("save step %d rank %d: %v", step, rank, err)
			}
			handles = append(handles, h)
		}
	}
	for _, h := range handles {
		if err := h.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func checkShard(t *testing.T, got *ckptd.Shard, want *ckptd.SaveRequest) {
	t.Helper()
	if got.Step != want.Step || got.WorldSize != want.WorldSize || !bytes.Equal(got.Metadata, want.Metadata) {
		t.Fatalf("shard header: step %d world %d metadata %q", got.Step, got.WorldSize, got.Metadata)
	}
	byName := map[string]ckptd.Tensor{}
	for _, tn := range got.Tensors {
		byName[tn.Name] = tn
	}
	for _, w := range want.Tensors {
		g, ok := byName[w.Name]
		if !ok || g.DType != w.DType || fmt.Sprint(g.Shape) != fmt.Sprint(w.Shape) || !bytes.Equal(g.Data, w.Data) {
			t.Fatalf("tensor %s differs after restore", w.Name)
		}
	}
}

// checkSafetensors compares a restored rank file with what was saved.
func checkSafetensors(t *testing.T, path string, want *ckptd.SaveRequest) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	tensors, _, start, err := safetensors.ParseHeader(f, fi.Size())
	if err != nil {
		t.Fatal(err)
	}
	if len(tensors) != len(want.Tensors) {
		t.Fatalf("%s: %d tensors, want %d", path, len(tensors), len(want.Tensors))
	}
	for i, w := range want.Tensors {
		g := tensors[i]
		data := make([]byte, g.End-g.Begin)
		if _, err := f.ReadAt(data, start+g.Begin); err != nil && len(data) > 0 {
			t.Fatal(err)
		}
		if g.Name != w.Name || string(g.DType) != w.DType || !bytes.Equal(data, w.Data) {
			t.Fatalf("%s: tensor %d (%s) differs", path, i, g.Name)
		}
	}
}

func TestSaveRestoreSeveralRanksAndSteps(t *testing.T) {
	d := startDaemon(t, "", "--chunk-size", "1MiB")
	c := d.client()
	const world = 3
	saveAll(t, c, []int64{100, 200}, world, false)
	saveAll(t, c, []int64{300}, world, true) // the streaming fallback

	steps, err := c.Steps(ctxT(t), "")
	if err != nil || len(steps) != 3 || steps[2].Step != 300 || steps[0].WorldSize != world {
		t.Fatalf("Steps = %+v, %v", steps, err)
	}
	for _, step := range []int64{100, 300} {
		for rank := range world {
			got, err := c.Load(ctxT(t), &ckptd.LoadRequest{Step: step, Rank: rank})
			if err != nil {
				t.Fatal(err)
			}
			checkShard(t, got, shard(step, rank, world))
		}
	}
	got, err := c.LoadStream(ctxT(t), &ckptd.LoadRequest{Latest: true, Rank: 1})
	if err != nil {
		t.Fatal(err)
	}
	checkShard(t, got, shard(300, 1, world))

	// The CLI reads storage directly, daemon or not.
	out := t.TempDir()
	if _, stderr, err := ckptdCLI(t, "restore", "--storage", d.storage, "--job", "e2e", "--step", "200", "--out", out); err != nil {
		t.Fatalf("restore: %v\n%s", err, stderr)
	}
	for rank := range world {
		checkSafetensors(t, filepath.Join(out, fmt.Sprintf("rank-%05d.safetensors", rank)), shard(200, rank, world))
	}
	var meta struct {
		Step  int64
		Ranks []struct {
			Rank     int
			Metadata []byte
		}
	}
	b, _ := os.ReadFile(filepath.Join(out, "metadata.json"))
	if err := json.Unmarshal(b, &meta); err != nil || meta.Step != 200 || len(meta.Ranks) != world ||
		string(meta.Ranks[2].Metadata) != string(shard(200, 2, world).Metadata) {
		t.Fatalf("metadata.json: %s (%v)", b, err)
	}

	stdout, _, err := ckptdCLI(t, "list", "--storage", d.storage, "--job", "e2e", "--json")
	var listed []struct{ Step int64 }
	if err != nil || json.Unmarshal([]byte(stdout), &listed) != nil || len(listed) != 3 {
		t.Fatalf("list --json: %v\n%s", err, stdout)
	}
	if stdout, _, err = ckptdCLI(t, "verify", "--storage", d.storage, "--job", "e2e", "--latest"); err != nil || !strings.Contains(stdout, "step 300 OK") {
		t.Fatalf("verify: %v %s", err, stdout)
	}
	if stdout, _, err = ckptdCLI(t, "prune", "--storage", d.storage, "--job", "e2e", "--keep-last", "1"); err != nil {
		t.Fatalf("prune: %v %s", err, stdout)
	}
	if steps, _ := c.Steps(ctxT(t), ""); len(steps) != 1 || steps[0].Step != 300 {
		t.Fatalf("after prune: %+v", steps)
	}
}

// Two sidecars sharing one storage folder, each saving half the ranks of
// a step, commit it exactly once with no coordinator.
func TestTwoDaemonsCommitOnce(t *testing.T) {
	store := filepath.Join(t.TempDir(), "shared")
	commitOnceAcross(t, startDaemon(t, store), startDaemon(t, store))
}

// commitOnceAcross saves steps 1-3 of world size 4 through two daemons
// sharing one store, even ranks through a and odd ones through b, and
// checks that each step was committed by exactly one of them and restores.
func commitOnceAcross(t *testing.T, a, b *daemon) {
	t.Helper()
	ca, cb := a.client(), b.client()
	const world = 4
	for _, step := range []int64{1, 2, 3} {
		var wg sync.WaitGroup
		errs := make(chan error, world)
		for rank := range world {
			c := ca
			if rank%2 == 1 {
				c = cb
			}
			wg.Go(func() {
				h, err := c.Save(ctxT(t), shard(step, rank, world))
				if err == nil {
					err = h.Wait(ctxT(t))
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	time.Sleep(200 * time.Millisecond) // let log lines arrive
	logs := a.logs() + b.logs()
	for _, step := range []string{"step=1", "step=2", "step=3"} {
		n := 0
		for _, l := range strings.Split(logs, "\n") {
			if strings.Contains(l, `msg="step committed"`) && strings.Contains(l, step) {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%s committed %d times\n%s", step, n, logs)
		}
	}
	for rank := range world {
		got, err := cb.Load(ctxT(t), &ckptd.LoadRequest{Step: 2, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		checkShard(t, got, shard(2, rank, world))
	}
}

// A save acknowledged to the trainer survives kill -9 of the daemon before
// it is durable: the restarted daemon finds it in the shared-memory
// journal, drains it, and commits the step with the right bytes.
func TestCrashRecovery(t *testing.T) {
	d := startDaemon(t, "", "--debug-drain-delay", "1h")
	c := d.client()
	want := []*ckptd.SaveRequest{shard(42, 0, 2), shard(42, 1, 2)}
	for _, req := range want {
		if _, err := c.Save(ctxT(t), req); err != nil {
			t.Fatal(err)
		}
	}
	if steps, _ := c.Steps(ctxT(t), ""); len(steps) != 0 {
		t.Fatal("step committed despite the drain delay")
	}
	d.kill9()
	if _, err := os.Stat(filepath.Join(d.storage, "e2e/steps/000000000042/COMMIT.json")); err == nil {
		t.Fatal("step committed before the crash")
	}
	d.start("--debug-drain-delay", "0s")
	c2 := d.client()
	for rank, req := range want {
		h, err := c2.Save(ctxT(t), req)
		if err == nil || !strings.Contains(err.Error(), "already") {
			t.Fatalf("re-saving a recovered rank: %v, %v", h, err)
		}
		if err := waitStep(t, c2, 42, rank); err != nil {
			t.Fatal(err)
		}
	}
	for rank, req := range want {
		got, err := c2.Load(ctxT(t), &ckptd.LoadRequest{Step: 42, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		checkShard(t, got, req)
	}
	if !strings.Contains(d.logs(), "recovered staged save") {
		t.Errorf("no recovery logged:\n%s", d.logs())
	}
}

// waitStep waits for a save through a fresh handle, as a trainer that
// reconnected after a daemon restart would.
func waitStep(t *testing.T, c *ckptd.Client, step int64, rank int) error {
	return c.Handle("", step, rank).Wait(ctxT(t))
}

// SIGTERM finishes the drains in flight before the daemon exits.
func TestGracefulShutdownDrains(t *testing.T) {
	d := startDaemon(t, "", "--debug-drain-delay", "300ms")
	c := d.client()
	if _, err := c.Save(ctxT(t), shard(7, 0, 1)); err != nil {
		t.Fatal(err)
	}
	d.stop()
	if d.cmd.ProcessState.ExitCode() != 0 {
		t.Fatalf("exit code %d\n%s", d.cmd.ProcessState.ExitCode(), d.logs())
	}
	if _, err := os.Stat(filepath.Join(d.storage, "e2e/steps/000000000007/COMMIT.json")); err != nil {
		t.Fatalf("step not committed at shutdown: %v\n%s", err, d.logs())
	}
	if _, err := os.Stat(d.arena); !os.IsNotExist(err) {
		t.Fatalf("arena left in /dev/shm after a clean shutdown: %v", err)
	}
}

// A daemon restarted after a clean exit makes a new arena file; a client
// that mapped the old one must notice and map the new one, or its bytes
// would never reach the daemon.
func TestClientRemapsAfterDaemonRestart(t *testing.T) {
	d := startDaemon(t, "")
	c := d.client()
	h, err := c.Save(ctxT(t), shard(1, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if st, err := h.Status(ctxT(t)); err != nil || st.String() != "SAVE_STATE_COMMITTED" {
		t.Fatalf("Status = %v, %v", st, err)
	}
	d.stop()
	d.start()
	h, err = c.Save(ctxT(t), shard(2, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	got, err := c.Load(ctxT(t), &ckptd.LoadRequest{Step: 2})
	if err != nil {
		t.Fatal(err)
	}
	checkShard(t, got, shard(2, 0, 1))
}

// A journaled save replayed after a crash must never rewrite a rank a
// committed step may point to. When storage already holds the save's very
// bytes (a crash between the write and the journal delete), the replay
// keeps them and reports committed; when the step was committed with
// other bytes for the rank (another daemon saved it meanwhile), the replay
// fails, naming the conflict, and the committed step is left as it was.
func TestReplayDoesNotRewriteCommittedStep(t *testing.T) {
	otherBytes := shard(9, 0, 1)
	otherBytes.Tensors[0].Data = append([]byte(nil), otherBytes.Tensors[0].Data...)
	otherBytes.Tensors[0].Data[0] ^= 0xff
	otherTensors := shard(9, 0, 1)
	otherTensors.Tensors = otherTensors.Tensors[:1]
	for _, tc := range []struct {
		name  string
		other *ckptd.SaveRequest // what a second daemon commits for the rank
		fail  bool
	}{
		{"same bytes", shard(9, 0, 1), false},
		{"other bytes", otherBytes, true},
		{"other tensors", otherTensors, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := startDaemon(t, "", "--debug-drain-delay", "1h")
			if _, err := a.client().Save(ctxT(t), shard(9, 0, 1)); err != nil {
				t.Fatal(err)
			}
			a.kill9() // accepted and journaled, not written
			b := startDaemon(t, a.storage)
			if _, err := b.client().Save(ctxT(t), tc.other); err != nil {
				t.Fatal(err)
			}
			if err := waitStep(t, b.client(), 9, 0); err != nil {
				t.Fatal(err)
			}
			data := filepath.Join(a.storage, "e2e/steps/000000000009/"+testAttempt+"/rank-00000.data")
			before, err := os.Stat(data)
			if err != nil {
				t.Fatal(err)
			}
			a.start("--debug-drain-delay", "0s") // replays the journal
			err = waitStep(t, a.client(), 9, 0)
			if tc.fail != (err != nil) || tc.fail && !strings.Contains(err.Error(), "was not written") {
				t.Fatalf("replayed save: %v (want failure: %v)\n%s", err, tc.fail, a.logs())
			}
			got, err := a.client().Load(ctxT(t), &ckptd.LoadRequest{Step: 9, Rank: 0})
			if err != nil {
				t.Fatal(err)
			}
			checkShard(t, got, tc.other)
			if after, err := os.Stat(data); err != nil || !after.ModTime().Equal(before.ModTime()) {
				t.Errorf("the committed rank's data object was rewritten (%v)", err)
			}
		})
	}
}

// A replayed save of a rank the committed step does not include (the step
// was committed with another world size meanwhile) fails rather than
// writing into a final step and reporting success.
func TestReplayIntoStepCommittedWithOtherWorldSize(t *testing.T) {
	a := startDaemon(t, "", "--debug-drain-delay", "1h")
	if _, err := a.client().Save(ctxT(t), shard(9, 3, 4)); err != nil {
		t.Fatal(err)
	}
	a.kill9()
	b := startDaemon(t, a.storage)
	if _, err := b.client().Save(ctxT(t), shard(9, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := waitStep(t, b.client(), 9, 0); err != nil {
		t.Fatal(err)
	}
	a.start("--debug-drain-delay", "0s")
	if err := waitStep(t, a.client(), 9, 3); err == nil || !strings.Contains(err.Error(), "was not written") {
		t.Fatalf("replayed rank 3 of 4 into a step committed with world size 1: %v\n%s", err, a.logs())
	}
	if _, err := os.Stat(filepath.Join(a.storage, "e2e/steps/000000000009/"+testAttempt+"/rank-00003.manifest.json")); err == nil {
		t.Error("the replay wrote into the committed step")
	}
}
