package attempts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// attemptShard is daemontest.Shard(step, rank, world) with bytes that name the
// attempt, so a step mixing two runs shows in its data.
func attemptShard(attempt string, step int64, rank, world int) *ckptd.SaveRequest {
	req := daemontest.Shard(step, rank, world)
	req.Attempt = attempt
	w := append([]byte(nil), req.Tensors[0].Data...)
	copy(w, attempt)
	req.Tensors[0].Data = w
	return req
}

// store is where the attempt tests run: a directory or a MinIO bucket.
type store struct {
	url string
	env []string
	// remove deletes an object of the store (a name under the URL), put
	// writes one.
	remove func(t *testing.T, name string)
	put    func(t *testing.T, name string, data []byte)
}

func stores(t *testing.T) map[string]func(t *testing.T) store {
	return map[string]func(t *testing.T) store{
		"posix": func(t *testing.T) store {
			dir := t.TempDir()
			return store{url: dir, remove: func(t *testing.T, name string) {
				if err := os.Remove(filepath.Join(dir, name)); err != nil {
					t.Fatal(err)
				}
			}, put: func(t *testing.T, name string, data []byte) {
				p := filepath.Join(dir, name)
				if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, data, 0o640); err != nil {
					t.Fatal(err)
				}
			}}
		},
		"s3": func(t *testing.T) store {
			srv, bucket, url := daemontest.S3Store(t)
			return store{url: url, env: srv.Env(), remove: func(t *testing.T, name string) {
				if err := srv.Client().RemoveObject(t.Context(), bucket, "ckpt/"+name, minio.RemoveObjectOptions{}); err != nil {
					t.Fatal(err)
				}
			}, put: func(t *testing.T, name string, data []byte) {
				if _, err := srv.Client().PutObject(t.Context(), bucket, "ckpt/"+name, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{}); err != nil {
					t.Fatal(err)
				}
			}}
		},
	}
}

func (s store) daemon(t *testing.T, extra ...string) *daemontest.Daemon {
	return daemontest.StartEnv(t, s.url, s.env, extra...)
}

// checkCommitted checks that step is committed by attempt at world size
// world, and that every rank restores with that attempt's bytes.
func checkCommitted(t *testing.T, c *ckptd.Client, step int64, attempt string, world int) {
	t.Helper()
	for rank := range world {
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: step, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		if got.Attempt != attempt {
			t.Fatalf("step %d rank %d restored from attempt %q, want %q", step, rank, got.Attempt, attempt)
		}
		daemontest.CheckShard(t, got, attemptShard(attempt, step, rank, world))
	}
}

// waitDurable waits until a save is at least durable (its step may stay
// uncommitted).
func waitDurable(t *testing.T, h *ckptd.SaveHandle) {
	t.Helper()
	for ctx := daemontest.Ctx(t); ctx.Err() == nil; {
		st, err := h.Status(ctx)
		if err == nil && st >= 3 { // DURABLE, COMMITTED or FAILED
			return
		}
	}
	t.Fatal("save not durable in time")
}

// The three failures of fixed object names, now each committing exactly
// one attempt's ranks.
func TestAttempts(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			t.Run("crashed run's rank is not mixed in", func(t *testing.T) {
				d := mk(t).daemon(t)
				c := d.Client()
				waitDurable(t, daemontest.Save(t, c, attemptShard("a", 100, 0, 2)))
				hb1 := daemontest.Save(t, c, attemptShard("b", 100, 1, 2))
				hb0 := daemontest.Save(t, c, attemptShard("b", 100, 0, 2)) // not refused: the rank of "a" is another run's
				for _, h := range []*ckptd.SaveHandle{hb0, hb1} {
					if err := h.Wait(daemontest.Ctx(t)); err != nil {
						t.Fatal(err)
					}
				}
				checkCommitted(t, c, 100, "b", 2)
			})
			t.Run("rerun at another world size commits", func(t *testing.T) {
				d := mk(t).daemon(t)
				c := d.Client()
				waitDurable(t, daemontest.Save(t, c, attemptShard("big", 100, 2, 4)))
				waitDurable(t, daemontest.Save(t, c, attemptShard("big", 100, 3, 4)))
				daemontest.SaveAndWait(t, c, attemptShard("small", 100, 0, 2), attemptShard("small", 100, 1, 2))
				checkCommitted(t, c, 100, "small", 2)
			})
			t.Run("late drain of an old run cannot touch the new one", func(t *testing.T) {
				s := mk(t)
				old := s.daemon(t, "--debug-drain-delay", "1h")
				daemontest.Save(t, old.Client(), attemptShard("old", 100, 0, 1))
				old.Kill9() // accepted and journaled, not written
				d := s.daemon(t)
				daemontest.SaveAndWait(t, d.Client(), attemptShard("new", 100, 0, 1))
				d.Stop()
				old.Start("--debug-drain-delay", "0s") // replays the old run's save
				err := waitAttempt(t, old.Client(), "old", 100, 0)
				if err == nil || !strings.Contains(err.Error(), `attempt "new"`) {
					t.Fatalf("the old run's replayed save: %v\n%s", err, old.Logs())
				}
				// Refused late, it says why as a save refused at once does.
				if !errors.Is(err, ckptd.ErrStepCommitted) || ckptd.Reason(err) != "STEP_COMMITTED" || ckptd.ReasonMetadata(err)["attempt"] != "new" {
					t.Fatalf("the old run's replayed save: %v (reason %q %v), want STEP_COMMITTED naming attempt new",
						err, ckptd.Reason(err), ckptd.ReasonMetadata(err))
				}
				checkCommitted(t, old.Client(), 100, "new", 1)
				out, _, err := daemontest.CLIEnv(t, s.env, "list", "--all", "--json", "--storage", s.url, "--job", "e2e")
				if err != nil {
					t.Fatal(err)
				}
				if strings.Contains(out, `"old"`) {
					t.Errorf("the old run's objects were not removed:\n%s", out)
				}
			})
		})
	}
}

// waitAttempt waits for attempt's save of step and rank.
func waitAttempt(t *testing.T, c *ckptd.Client, attempt string, step int64, rank int) error {
	t.Helper()
	ac, err := ckptd.Dial(c.Socket(), ckptd.WithAttempt(attempt))
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	return ac.Handle("", step, rank).Wait(daemontest.Ctx(t))
}

// Two daemons sharing a store, each saving every rank of its own attempt
// of one step at once: one commit, all its ranks from one attempt, and the
// loser is told which attempt won.
func TestAttemptsRace(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := mk(t)
			a, b := s.daemon(t), s.daemon(t)
			const world = 3
			errs := map[string]error{}
			var mu sync.Mutex
			var wg sync.WaitGroup
			for attempt, d := range map[string]*daemontest.Daemon{"x": a, "y": b} {
				wg.Go(func() {
					c := d.Client()
					var hs []*ckptd.SaveHandle
					var err error
					for rank := range world {
						h, serr := c.Save(daemontest.Ctx(t), attemptShard(attempt, 5, rank, world))
						if serr != nil { // refused at once: the other attempt had committed
							err = serr
							break
						}
						hs = append(hs, h)
					}
					for _, h := range hs {
						err = errors.Join(err, h.Wait(daemontest.Ctx(t)))
					}
					mu.Lock()
					errs[attempt] = err
					mu.Unlock()
				})
			}
			wg.Wait()
			winner, loser := "x", "y"
			if errs["x"] != nil {
				winner, loser = "y", "x"
			}
			if errs[winner] != nil || errs[loser] == nil || !strings.Contains(errs[loser].Error(), fmt.Sprintf("attempt %q", winner)) {
				t.Fatalf("outcomes: %v", errs)
			}
			checkCommitted(t, a.Client(), 5, winner, world)
			commits := strings.Count(a.Logs(), "step committed") + strings.Count(b.Logs(), "step committed")
			if commits != 1 {
				t.Fatalf("%d commit records written", commits)
			}
		})
	}
}

// A crash between a run's manifests and its commit, then the next run: it
// commits cleanly, list --all shows the leftovers and a half-written step,
// and prune removes the leftovers (the half-written step once past the
// grace) while the committed step stays restorable. Two crashes: after one
// rank of two was written (a real kill -9), and after every rank's
// manifest but before the commit record (the commit record of a finished
// save is deleted: the store then holds what that crash leaves when the
// node's journal is lost with it).
func TestAttemptLeftoversPruned(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := mk(t)
			d := s.daemon(t)
			c := d.Client()
			waitDurable(t, daemontest.Save(t, c, attemptShard("crashed", 7, 0, 2)))
			d.Kill9()
			d.Start()
			c = d.Client()
			daemontest.SaveAndWait(t, c, attemptShard("all-manifests", 8, 0, 2), attemptShard("all-manifests", 8, 1, 2))
			s.remove(t, "e2e/steps/000000000008/COMMIT.json")
			for _, step := range []int64{7, 8} {
				daemontest.SaveAndWait(t, c, attemptShard("rerun", step, 0, 2), attemptShard("rerun", step, 1, 2))
				checkCommitted(t, c, step, "rerun", 2)
			}
			waitDurable(t, daemontest.Save(t, c, attemptShard("half", 9, 0, 2)))

			want := map[string]listRow{
				"7/crashed": {State: "garbage", Ranks: 1}, "7/rerun": {State: "committed", Ranks: 2},
				"8/all-manifests": {State: "garbage", Ranks: 2}, "8/rerun": {State: "committed", Ranks: 2},
				"9/half": {State: "uncommitted", Ranks: 1},
			}
			checkListAll(t, s, want)
			out, _, err := daemontest.CLIEnv(t, s.env, "prune", "--storage", s.url, "--job", "e2e", "--keep-last", "2")
			if err != nil || !strings.Contains(out, "7/crashed") || !strings.Contains(out, "8/all-manifests") || strings.Contains(out, "9/half") {
				t.Fatalf("prune: %s %v", out, err)
			}
			delete(want, "7/crashed")
			delete(want, "8/all-manifests")
			checkListAll(t, s, want)
			// Past the grace, the half-written step goes too.
			time.Sleep(20 * time.Millisecond)
			if out, _, err := daemontest.CLIEnv(t, s.env, "prune", "--storage", s.url, "--job", "e2e", "--keep-last", "2", "--gc-grace", "10ms"); err != nil || !strings.Contains(out, "9/half") {
				t.Fatalf("prune --gc-grace 10ms: %s %v", out, err)
			}
			delete(want, "9/half")
			checkListAll(t, s, want)
			if out, _, err := daemontest.CLIEnv(t, s.env, "verify", "--storage", s.url, "--job", "e2e", "--latest"); err != nil {
				t.Fatalf("verify after prune: %s %v", out, err)
			}
			for _, step := range []int64{7, 8} {
				checkCommitted(t, c, step, "rerun", 2)
			}
		})
	}
}

type listRow struct {
	Step      int64
	Attempt   string
	State     string
	Ranks     int `json:"ranks"`
	WorldSize int `json:"world_size"`
}

// checkListAll checks what `ckptd list --all --json` shows: want is keyed
// by step/attempt, world size 2 for all.
func checkListAll(t *testing.T, s store, want map[string]listRow) {
	t.Helper()
	out, _, err := daemontest.CLIEnv(t, s.env, "list", "--all", "--json", "--storage", s.url, "--job", "e2e")
	if err != nil {
		t.Fatal(err)
	}
	var rows []listRow
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("list --all: %s %v", out, err)
	}
	got := map[string]listRow{}
	for _, r := range rows {
		got[fmt.Sprintf("%d/%s", r.Step, r.Attempt)] = listRow{State: r.State, Ranks: r.Ranks}
		if r.WorldSize != 2 {
			t.Errorf("list --all row %+v: world size %d, want 2", r, r.WorldSize)
		}
	}
	if !maps.Equal(got, want) {
		t.Errorf("list --all:\n got %v\nwant %v\n%s", got, want, out)
	}
}

// A save of a step another attempt committed is refused at once, naming
// that attempt, with a structured reason.
func TestSaveOfStepCommittedByAnotherAttempt(t *testing.T) {
	d := daemontest.Start(t, "")
	c := d.Client()
	daemontest.SaveAndWait(t, c, attemptShard("first", 3, 0, 1))
	_, err := c.Save(daemontest.Ctx(t), attemptShard("second", 3, 0, 1))
	if status.Code(daemontest.UnwrapStatus(err)) != codes.AlreadyExists || !strings.Contains(err.Error(), `attempt "first"`) || ckptd.Reason(err) != "STEP_COMMITTED" {
		t.Fatalf("save of a committed step: %v (reason %q)", err, ckptd.Reason(err))
	}
}

// The Go client's errors match its sentinels by the daemon's reason.
func TestGoClientSentinels(t *testing.T) {
	d := daemontest.Start(t, "")
	c := d.Client()
	daemontest.SaveAndWait(t, c, attemptShard("first", 3, 0, 1))
	_, err := c.Save(daemontest.Ctx(t), attemptShard("second", 3, 0, 1))
	if !errors.Is(err, ckptd.ErrStepCommitted) || errors.Is(err, ckptd.ErrSaveInProgress) {
		t.Fatalf("save of a committed step: %v", err)
	}
	if _, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 99}); !errors.Is(err, ckptd.ErrNotFound) {
		t.Fatalf("load of an unknown step: %v", err)
	}
	if _, err := c.Save(daemontest.Ctx(t), &ckptd.SaveRequest{Step: -1, WorldSize: 1}); !errors.Is(err, ckptd.ErrInvalid) {
		t.Fatalf("save of step -1: %v", err)
	}
}
