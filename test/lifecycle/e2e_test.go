package lifecycle

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

func TestSaveRestoreSeveralRanksAndSteps(t *testing.T) {
	d := daemontest.Start(t, "", "--chunk-size", "1MiB")
	c := d.Client()
	const world = 3
	daemontest.SaveAll(t, c, []int64{100, 200}, world, false)
	daemontest.SaveAll(t, c, []int64{300}, world, true) // the streaming fallback

	steps, err := c.Steps(daemontest.Ctx(t), "")
	if err != nil || len(steps) != 3 || steps[2].Step != 300 || steps[0].WorldSize != world {
		t.Fatalf("Steps = %+v, %v", steps, err)
	}
	for _, step := range []int64{100, 300} {
		for rank := range world {
			got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: step, Rank: rank})
			if err != nil {
				t.Fatal(err)
			}
			daemontest.CheckShard(t, got, daemontest.Shard(step, rank, world))
		}
	}
	got, err := c.LoadStream(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: 1})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(300, 1, world))

	// The CLI reads storage directly, daemon or not.
	out := t.TempDir()
	if _, stderr, err := daemontest.CLI(t, "restore", "--storage", d.Storage, "--job", "e2e", "--step", "200", "--out", out); err != nil {
		t.Fatalf("restore: %v\n%s", err, stderr)
	}
	for rank := range world {
		daemontest.CheckSafetensors(t, filepath.Join(out, fmt.Sprintf("rank-%05d.safetensors", rank)), daemontest.Shard(200, rank, world))
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
		string(meta.Ranks[2].Metadata) != string(daemontest.Shard(200, 2, world).Metadata) {
		t.Fatalf("metadata.json: %s (%v)", b, err)
	}

	stdout, _, err := daemontest.CLI(t, "list", "--storage", d.Storage, "--job", "e2e", "--json")
	var listed []struct{ Step int64 }
	if err != nil || json.Unmarshal([]byte(stdout), &listed) != nil || len(listed) != 3 {
		t.Fatalf("list --json: %v\n%s", err, stdout)
	}
	if stdout, _, err = daemontest.CLI(t, "verify", "--storage", d.Storage, "--job", "e2e", "--latest"); err != nil || !strings.Contains(stdout, "step 300 OK") {
		t.Fatalf("verify: %v %s", err, stdout)
	}
	if stdout, _, err = daemontest.CLI(t, "prune", "--storage", d.Storage, "--job", "e2e", "--keep-last", "1"); err != nil {
		t.Fatalf("prune: %v %s", err, stdout)
	}
	if steps, _ := c.Steps(daemontest.Ctx(t), ""); len(steps) != 1 || steps[0].Step != 300 {
		t.Fatalf("after prune: %+v", steps)
	}
}

// Two sidecars sharing one storage folder, each saving half the ranks of
// a step, commit it exactly once with no coordinator.
func TestTwoDaemonsCommitOnce(t *testing.T) {
	store := filepath.Join(t.TempDir(), "shared")
	daemontest.CommitOnceAcross(t, daemontest.Start(t, store), daemontest.Start(t, store))
}

// A save acknowledged to the trainer survives kill -9 of the daemon before
// it is durable: the restarted daemon finds it in the shared-memory
// journal, drains it, and commits the step with the right bytes.
func TestCrashRecovery(t *testing.T) {
	d := daemontest.Start(t, "", "--debug-drain-delay", "1h")
	c := d.Client()
	want := []*ckptd.SaveRequest{daemontest.Shard(42, 0, 2), daemontest.Shard(42, 1, 2)}
	for _, req := range want {
		if _, err := c.Save(daemontest.Ctx(t), req); err != nil {
			t.Fatal(err)
		}
	}
	if steps, _ := c.Steps(daemontest.Ctx(t), ""); len(steps) != 0 {
		t.Fatal("step committed despite the drain delay")
	}
	d.Kill9()
	if _, err := os.Stat(filepath.Join(d.Storage, "e2e/steps/000000000042/COMMIT.json")); err == nil {
		t.Fatal("step committed before the crash")
	}
	d.Start("--debug-drain-delay", "0s")
	c2 := d.Client()
	for rank, req := range want {
		h, err := c2.Save(daemontest.Ctx(t), req)
		if err == nil || !strings.Contains(err.Error(), "already") {
			t.Fatalf("re-saving a recovered rank: %v, %v", h, err)
		}
		if err := daemontest.WaitStep(t, c2, 42, rank); err != nil {
			t.Fatal(err)
		}
	}
	for rank, req := range want {
		got, err := c2.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 42, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, req)
	}
	if !strings.Contains(d.Logs(), "recovered staged save") {
		t.Errorf("no recovery logged:\n%s", d.Logs())
	}
}

// SIGTERM finishes the drains in flight before the daemon exits.
func TestGracefulShutdownDrains(t *testing.T) {
	d := daemontest.Start(t, "", "--debug-drain-delay", "300ms")
	c := d.Client()
	if _, err := c.Save(daemontest.Ctx(t), daemontest.Shard(7, 0, 1)); err != nil {
		t.Fatal(err)
	}
	d.Stop()
	if d.Cmd.ProcessState.ExitCode() != 0 {
		t.Fatalf("exit code %d\n%s", d.Cmd.ProcessState.ExitCode(), d.Logs())
	}
	if _, err := os.Stat(filepath.Join(d.Storage, "e2e/steps/000000000007/COMMIT.json")); err != nil {
		t.Fatalf("step not committed at shutdown: %v\n%s", err, d.Logs())
	}
	if _, err := os.Stat(d.Arena); !os.IsNotExist(err) {
		t.Fatalf("arena left in /dev/shm after a clean shutdown: %v", err)
	}
}

// A daemon restarted after a clean exit makes a new arena file; a client
// that mapped the old one must notice and map the new one, or its bytes
// would never reach the daemon.
func TestClientRemapsAfterDaemonRestart(t *testing.T) {
	d := daemontest.Start(t, "")
	c := d.Client()
	h, err := c.Save(daemontest.Ctx(t), daemontest.Shard(1, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	if st, err := h.Status(daemontest.Ctx(t)); err != nil || st.String() != "SAVE_STATE_COMMITTED" {
		t.Fatalf("Status = %v, %v", st, err)
	}
	d.Stop()
	d.Start()
	h, err = c.Save(daemontest.Ctx(t), daemontest.Shard(2, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 2})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(2, 0, 1))
}

// A journaled save replayed after a crash must never rewrite a rank a
// committed step may point to. When storage already holds the save's very
// bytes (a crash between the write and the journal delete), the replay
// keeps them and reports committed; when the step was committed with
// other bytes for the rank (another daemon saved it meanwhile), the replay
// fails, naming the conflict, and the committed step is left as it was.
func TestReplayDoesNotRewriteCommittedStep(t *testing.T) {
	otherBytes := daemontest.Shard(9, 0, 1)
	otherBytes.Tensors[0].Data = append([]byte(nil), otherBytes.Tensors[0].Data...)
	otherBytes.Tensors[0].Data[0] ^= 0xff
	otherTensors := daemontest.Shard(9, 0, 1)
	otherTensors.Tensors = otherTensors.Tensors[:1]
	for _, tc := range []struct {
		name  string
		other *ckptd.SaveRequest // what a second daemon commits for the rank
		fail  bool
	}{
		{"same bytes", daemontest.Shard(9, 0, 1), false},
		{"other bytes", otherBytes, true},
		{"other tensors", otherTensors, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := daemontest.Start(t, "", "--debug-drain-delay", "1h")
			if _, err := a.Client().Save(daemontest.Ctx(t), daemontest.Shard(9, 0, 1)); err != nil {
				t.Fatal(err)
			}
			a.Kill9() // accepted and journaled, not written
			b := daemontest.Start(t, a.Storage)
			if _, err := b.Client().Save(daemontest.Ctx(t), tc.other); err != nil {
				t.Fatal(err)
			}
			if err := daemontest.WaitStep(t, b.Client(), 9, 0); err != nil {
				t.Fatal(err)
			}
			data := filepath.Join(a.Storage, "e2e/steps/000000000009/"+daemontest.Attempt+"/rank-00000.data")
			before, err := os.Stat(data)
			if err != nil {
				t.Fatal(err)
			}
			a.Start("--debug-drain-delay", "0s") // replays the journal
			err = daemontest.WaitStep(t, a.Client(), 9, 0)
			if tc.fail != (err != nil) || tc.fail && !strings.Contains(err.Error(), "was not written") {
				t.Fatalf("replayed save: %v (want failure: %v)\n%s", err, tc.fail, a.Logs())
			}
			got, err := a.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 9, Rank: 0})
			if err != nil {
				t.Fatal(err)
			}
			daemontest.CheckShard(t, got, tc.other)
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
	a := daemontest.Start(t, "", "--debug-drain-delay", "1h")
	if _, err := a.Client().Save(daemontest.Ctx(t), daemontest.Shard(9, 3, 4)); err != nil {
		t.Fatal(err)
	}
	a.Kill9()
	b := daemontest.Start(t, a.Storage)
	if _, err := b.Client().Save(daemontest.Ctx(t), daemontest.Shard(9, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := daemontest.WaitStep(t, b.Client(), 9, 0); err != nil {
		t.Fatal(err)
	}
	a.Start("--debug-drain-delay", "0s")
	if err := daemontest.WaitStep(t, a.Client(), 9, 3); err == nil || !strings.Contains(err.Error(), "was not written") {
		t.Fatalf("replayed rank 3 of 4 into a step committed with world size 1: %v\n%s", err, a.Logs())
	}
	if _, err := os.Stat(filepath.Join(a.Storage, "e2e/steps/000000000009/"+daemontest.Attempt+"/rank-00003.manifest.json")); err == nil {
		t.Error("the replay wrote into the committed step")
	}
}
