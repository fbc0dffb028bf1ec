package test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
)

// attemptShard is shard(step, rank, world) with bytes that name the
// attempt, so a step mixing two runs shows in its data.
func attemptShard(attempt string, step int64, rank, world int) *ckptd.SaveRequest {
	req := shard(step, rank, world)
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
}

func stores(t *testing.T) map[string]func(t *testing.T) store {
	return map[string]func(t *testing.T) store{
		"posix": func(t *testing.T) store { return store{url: t.TempDir()} },
		"s3": func(t *testing.T) store {
			srv, _, url := s3Store(t)
			return store{url: url, env: srv.Env()}
		},
	}
}

func (s store) daemon(t *testing.T, extra ...string) *daemon {
	return startDaemonEnv(t, s.url, s.env, extra...)
}

// checkCommitted checks that step is committed by attempt at world size
// world, and that every rank restores with that attempt's bytes.
func checkCommitted(t *testing.T, c *ckptd.Client, step int64, attempt string, world int) {
	t.Helper()
	for rank := range world {
		got, err := c.Load(ctxT(t), &ckptd.LoadRequest{Step: step, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		if got.Attempt != attempt {
			t.Fatalf("step %d rank %d restored from attempt %q, want %q", step, rank, got.Attempt, attempt)
		}
		checkShard(t, got, attemptShard(attempt, step, rank, world))
	}
}

func save(t *testing.T, c *ckptd.Client, req *ckptd.SaveRequest) *ckptd.SaveHandle {
	t.Helper()
	h, err := c.Save(ctxT(t), req)
	if err != nil {
		t.Fatalf("save %s step %d rank %d: %v", req.Attempt, req.Step, req.Rank, err)
	}
	return h
}

// waitDurable waits until a save is at least durable (its step may stay
// uncommitted).
func waitDurable(t *testing.T, h *ckptd.SaveHandle) {
	t.Helper()
	for ctx := ctxT(t); ctx.Err() == nil; {
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
				c := d.client()
				waitDurable(t, save(t, c, attemptShard("a", 100, 0, 2)))
				hb1 := save(t, c, attemptShard("b", 100, 1, 2))
				hb0 := save(t, c, attemptShard("b", 100, 0, 2)) // not refused: the rank of "a" is another run's
				for _, h := range []*ckptd.SaveHandle{hb0, hb1} {
					if err := h.Wait(ctxT(t)); err != nil {
						t.Fatal(err)
					}
				}
				checkCommitted(t, c, 100, "b", 2)
			})
			t.Run("rerun at another world size commits", func(t *testing.T) {
				d := mk(t).daemon(t)
				c := d.client()
				waitDurable(t, save(t, c, attemptShard("big", 100, 2, 4)))
				waitDurable(t, save(t, c, attemptShard("big", 100, 3, 4)))
				saveAndWait(t, c, attemptShard("small", 100, 0, 2), attemptShard("small", 100, 1, 2))
				checkCommitted(t, c, 100, "small", 2)
			})
			t.Run("late drain of an old run cannot touch the new one", func(t *testing.T) {
				s := mk(t)
				old := s.daemon(t, "--debug-drain-delay", "1h")
				save(t, old.client(), attemptShard("old", 100, 0, 1))
				old.kill9() // accepted and journaled, not written
				d := s.daemon(t)
				saveAndWait(t, d.client(), attemptShard("new", 100, 0, 1))
				d.stop()
				old.start("--debug-drain-delay", "0s") // replays the old run's save
				err := waitAttempt(t, old.client(), "old", 100, 0)
				if err == nil || !strings.Contains(err.Error(), `attempt "new"`) {
					t.Fatalf("the old run's replayed save: %v\n%s", err, old.logs())
				}
				checkCommitted(t, old.client(), 100, "new", 1)
				out, _, err := ckptdCLIEnv(t, s.env, "list", "--all", "--json", "--storage", s.url, "--job", "e2e")
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

func saveAndWait(t *testing.T, c *ckptd.Client, reqs ...*ckptd.SaveRequest) {
	t.Helper()
	var hs []*ckptd.SaveHandle
	for _, r := range reqs {
		hs = append(hs, save(t, c, r))
	}
	for _, h := range hs {
		if err := h.Wait(ctxT(t)); err != nil {
			t.Fatal(err)
		}
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
	return ac.Handle("", step, rank).Wait(ctxT(t))
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
			for attempt, d := range map[string]*daemon{"x": a, "y": b} {
				wg.Go(func() {
					c := d.client()
					var hs []*ckptd.SaveHandle
					var err error
					for rank := range world {
						h, serr := c.Save(ctxT(t), attemptShard(attempt, 5, rank, world))
						if serr != nil { // refused at once: the other attempt had committed
							err = serr
							break
						}
						hs = append(hs, h)
					}
					for _, h := range hs {
						err = errors.Join(err, h.Wait(ctxT(t)))
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
			checkCommitted(t, a.client(), 5, winner, world)
			commits := strings.Count(a.logs(), "step committed") + strings.Count(b.logs(), "step committed")
			if commits != 1 {
				t.Fatalf("%d commit records written", commits)
			}
		})
	}
}

// A crash between a run's manifests and its commit, then the next run:
// it commits cleanly, list --all shows the leftovers, and prune removes
// them while the committed step stays restorable.
func TestAttemptLeftoversPruned(t *testing.T) {
	s := store{url: t.TempDir()}
	d := s.daemon(t)
	c := d.client()
	waitDurable(t, save(t, c, attemptShard("crashed", 7, 0, 2)))
	d.kill9()
	d.start()
	c = d.client()
	saveAndWait(t, c, attemptShard("rerun", 7, 0, 2), attemptShard("rerun", 7, 1, 2))
	checkCommitted(t, c, 7, "rerun", 2)

	out, _, err := ckptdCLI(t, "list", "--all", "--json", "--storage", s.url, "--job", "e2e")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		Attempt, State string
		Ranks          int `json:"ranks"`
		WorldSize      int `json:"world_size"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil || len(rows) != 2 {
		t.Fatalf("list --all: %s %v", out, err)
	}
	for _, r := range rows {
		want := map[string]string{"crashed": "garbage", "rerun": "committed"}[r.Attempt]
		if r.State != want || r.WorldSize != 2 {
			t.Errorf("list --all row %+v, want state %s", r, want)
		}
	}
	if out, _, err := ckptdCLI(t, "prune", "--storage", s.url, "--job", "e2e", "--keep-last", "1"); err != nil || !strings.Contains(out, "7/crashed") {
		t.Fatalf("prune: %s %v", out, err)
	}
	if out, _, err := ckptdCLI(t, "verify", "--storage", s.url, "--job", "e2e", "--latest"); err != nil {
		t.Fatalf("verify after prune: %s %v", out, err)
	}
	checkCommitted(t, c, 7, "rerun", 2)
}

// A save of a step another attempt committed is refused at once, naming
// that attempt, with a structured reason.
func TestSaveOfStepCommittedByAnotherAttempt(t *testing.T) {
	d := startDaemon(t, "")
	c := d.client()
	saveAndWait(t, c, attemptShard("first", 3, 0, 1))
	_, err := c.Save(ctxT(t), attemptShard("second", 3, 0, 1))
	if status.Code(unwrapStatus(err)) != codes.AlreadyExists || !strings.Contains(err.Error(), `attempt "first"`) || ckptd.Reason(err) != "STEP_COMMITTED" {
		t.Fatalf("save of a committed step: %v (reason %q)", err, ckptd.Reason(err))
	}
}

// The Go client's errors match its sentinels by the daemon's reason.
func TestGoClientSentinels(t *testing.T) {
	d := startDaemon(t, "")
	c := d.client()
	saveAndWait(t, c, attemptShard("first", 3, 0, 1))
	_, err := c.Save(ctxT(t), attemptShard("second", 3, 0, 1))
	if !errors.Is(err, ckptd.ErrStepCommitted) || errors.Is(err, ckptd.ErrSaveInProgress) {
		t.Fatalf("save of a committed step: %v", err)
	}
	if _, err := c.Load(ctxT(t), &ckptd.LoadRequest{Step: 99}); !errors.Is(err, ckptd.ErrNotFound) {
		t.Fatalf("load of an unknown step: %v", err)
	}
	if _, err := c.Save(ctxT(t), &ckptd.SaveRequest{Step: -1, WorldSize: 1}); !errors.Is(err, ckptd.ErrInvalid) {
		t.Fatalf("save of step -1: %v", err)
	}
}
