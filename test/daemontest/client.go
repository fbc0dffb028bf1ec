package daemontest

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
)

// Ctx is a context for one call of a test: a minute, scaled, and
// cancelled when the test ends.
func Ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(time.Minute))
	t.Cleanup(cancel)
	return ctx
}

// TestCtx is a context for every call of a test: ten minutes, scaled
// (a test of many calls on a busy machine takes minutes), cancelled when
// the test ends. A call that should answer at once takes Ctx.
func TestCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(10*time.Minute))
	t.Cleanup(cancel)
	return ctx
}

// WaitUntil polls cond for up to a minute (scaled).
func WaitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testtime.Until(t, time.Minute, what, cond)
}

// WaitLog waits until the daemons' logs hold line n times in all.
func WaitLog(t *testing.T, ds []*Daemon, line string, n int) {
	t.Helper()
	WaitUntil(t, "the daemons log "+line, func() bool {
		count := 0
		for _, d := range ds {
			count += strings.Count(d.Logs(), line)
		}
		return count >= n
	})
}

// Save saves req through c, failing the test if it is refused.
func Save(t *testing.T, c *ckptd.Client, req *ckptd.SaveRequest) *ckptd.SaveHandle {
	t.Helper()
	h, err := c.Save(Ctx(t), req)
	if err != nil {
		t.Fatalf("save %s step %d rank %d: %v", req.Attempt, req.Step, req.Rank, err)
	}
	return h
}

// SaveAndWait saves every request, then waits for each to commit.
func SaveAndWait(t *testing.T, c *ckptd.Client, reqs ...*ckptd.SaveRequest) {
	t.Helper()
	var hs []*ckptd.SaveHandle
	for _, r := range reqs {
		hs = append(hs, Save(t, c, r))
	}
	for _, h := range hs {
		if err := h.Wait(Ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
}

// SaveAll saves every rank of each step (Shard) through c, streamed or
// through the arena, and waits for the commits.
func SaveAll(t *testing.T, c *ckptd.Client, steps []int64, world int, stream bool) {
	t.Helper()
	var reqs []*ckptd.SaveRequest
	for _, step := range steps {
		for rank := range world {
			reqs = append(reqs, Shard(step, rank, world))
		}
	}
	if !stream {
		SaveAndWait(t, c, reqs...)
		return
	}
	var hs []*ckptd.SaveHandle
	for _, r := range reqs {
		h, err := c.SaveStream(Ctx(t), r)
		if err != nil {
			t.Fatalf("save step %d rank %d: %v", r.Step, r.Rank, err)
		}
		hs = append(hs, h)
	}
	for _, h := range hs {
		if err := h.Wait(Ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
}

// WaitStep waits for a save through a fresh handle, as a trainer that
// reconnected after a daemon restart would.
func WaitStep(t *testing.T, c *ckptd.Client, step int64, rank int) error {
	return c.Handle("", step, rank).Wait(Ctx(t))
}

// CommitOnceAcross saves steps 1-3 of world size 4 through two daemons
// sharing one store, even ranks through a and odd ones through b, and
// checks that each step restores and was committed by exactly one of them
// (stopping both, so that their logs are whole).
func CommitOnceAcross(t *testing.T, a, b *Daemon) {
	t.Helper()
	ca, cb := a.Client(), b.Client()
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
				h, err := c.Save(Ctx(t), Shard(step, rank, world))
				if err == nil {
					err = h.Wait(Ctx(t))
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
	for rank := range world {
		got, err := cb.Load(Ctx(t), &ckptd.LoadRequest{Step: 2, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		CheckShard(t, got, Shard(2, rank, world))
	}
	a.Stop()
	b.Stop()
	logs := a.Logs() + b.Logs()
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
}

// UnwrapStatus is the gRPC status error inside err (the Go client wraps
// them), or err.
func UnwrapStatus(err error) error {
	for e := err; e != nil; {
		if _, ok := status.FromError(e); ok {
			return e
		}
		u, ok := e.(interface{ Unwrap() error })
		if !ok {
			break
		}
		e = u.Unwrap()
	}
	return err
}

// CommittedAsSaved waits for each request's step to commit and checks that
// it loads as saved (rank 0 of each).
func CommittedAsSaved(t *testing.T, d *Daemon, c *ckptd.Client, saved []*ckptd.SaveRequest) {
	t.Helper()
	for _, req := range saved {
		if err := WaitStep(t, c, req.Step, 0); err != nil {
			t.Fatalf("step %d: %v\n%s", req.Step, err, d.Logs())
		}
		got, err := c.Load(Ctx(t), &ckptd.LoadRequest{Step: req.Step})
		if err != nil {
			t.Fatal(err)
		}
		CheckShard(t, got, req)
	}
}

// Spilled counts the saves' files in a --spill-dir folder (not its lock).
func Spilled(dir string) int {
	des, _ := os.ReadDir(dir)
	n := 0
	for _, de := range des {
		if de.Name() != ".lock" {
			n++
		}
	}
	return n
}
