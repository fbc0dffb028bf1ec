// Command scale measures how the cost of a checkpoint step grows with the
// number of ranks (`make bench-scale`): N simulated ranks (goroutines, each
// with its own client connection, as a trainer process has) spread over 8
// real `ckptd serve` daemons on loopback, saving small shards (64 KiB, so
// that bytes do not dominate) for 5 steps, to a real MinIO and to a POSIX
// folder. Then the interactive commands on the job: `ckptd list`,
// `restore --latest --rank R`, `verify --latest` and `prune`.
//
// S3 requests are counted from the storage side: every request goes
// through a proxy in front of MinIO that counts it by kind (each LIST page,
// multipart part and 404 counts) and notes when each step's last manifest
// and its commit record were written. A POSIX store has no such vantage
// point: its rows have times only (the same code makes the same calls of
// the backend, minus S3's multipart requests).
//
// With -throttle R the proxy answers 503 SlowDown past R requests per
// second per prefix, as S3 does past its per-prefix rates, to show the
// retries riding it out.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/miniotest"
)

type config struct {
	ranks     []int
	daemons   int
	steps     int
	shard     int
	backends  []string
	bin       string
	dir       string
	throttle  float64
	timeout   time.Duration
	serveArgs []string
	keep      bool
}

const bucket = "scale"

func main() {
	var cfg config
	ranks := flag.String("ranks", "16,64,256,1024", "rank counts to run, comma-separated")
	flag.IntVar(&cfg.daemons, "daemons", 8, "ckptd serve processes the ranks are spread over")
	flag.IntVar(&cfg.steps, "steps", 5, "steps each rank saves")
	flag.IntVar(&cfg.shard, "shard", 64<<10, "bytes per rank per step")
	backends := flag.String("backends", "s3,posix", "stores to run against: s3 (a MinIO started for the run), posix")
	flag.StringVar(&cfg.bin, "ckptd", "", "the ckptd binary (default: built from this tree into the work folder)")
	flag.StringVar(&cfg.dir, "dir", ".bench/scale", "work folder (stores, logs)")
	flag.Float64Var(&cfg.throttle, "throttle", 0, "S3 only: answer 503 SlowDown past this many requests per second per prefix (0: never)")
	flag.DurationVar(&cfg.timeout, "step-timeout", 10*time.Minute, "give up on a step (or a command) after this long")
	serveArgs := flag.String("serve-args", "", "more arguments for ckptd serve, space-separated")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the work folder (the daemons' logs, the stores)")
	flag.Parse()
	for _, s := range strings.Split(*ranks, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			fail(fmt.Errorf("-ranks: %q is not a rank count", s))
		}
		cfg.ranks = append(cfg.ranks, n)
	}
	cfg.backends = strings.Split(*backends, ",")
	cfg.serveArgs = strings.Fields(*serveArgs)
	if err := run(cfg); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench-scale:", err)
	os.Exit(1)
}

// env is what a run needs besides its config: the work folder, and for S3
// the MinIO server and the proxy in front of it.
type env struct {
	ctx  context.Context // ends on SIGINT or SIGTERM: the run stops, and cleans up
	cfg  config
	work string
	srv  *miniotest.Server
	px   *proxy
}

func run(cfg config) error {
	if err := os.MkdirAll(cfg.dir, 0o755); err != nil {
		return err
	}
	work, err := os.MkdirTemp(cfg.dir, "run-")
	if err != nil {
		return err
	}
	if work, err = filepath.Abs(work); err != nil {
		return err
	}
	if cfg.keep {
		fmt.Fprintln(os.Stderr, "work folder:", work)
	} else {
		defer os.RemoveAll(work)
	}
	if cfg.bin == "" {
		cfg.bin = filepath.Join(work, "ckptd")
		build := exec.Command("go", "build", "-o", cfg.bin, "./cmd/ckptd")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("build ckptd (run from the repository root, or give -ckptd): %w", err)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	e := &env{ctx: ctx, cfg: cfg, work: work}
	if slices.Contains(cfg.backends, "s3") {
		bin, err := miniotest.Binary()
		if err != nil {
			return err
		}
		if e.srv, err = miniotest.Launch(bin, filepath.Join(work, "minio")); err != nil {
			return err
		}
		defer e.srv.Close()
		if err := e.srv.CreateBucket(ctx, bucket); err != nil {
			return err
		}
		if e.px, err = startProxy(e.srv.Endpoint(), bucket); err != nil {
			return err
		}
		defer e.px.close()
		e.px.throttle(cfg.throttle)
	}
	fmt.Printf("ckptd scale benchmark: %d daemons, %d KiB shards, %d steps, ranks %v, ckptd %s\n",
		cfg.daemons, cfg.shard>>10, cfg.steps, cfg.ranks, cfg.bin)
	for _, backend := range cfg.backends {
		var results []*result
		for _, n := range cfg.ranks {
			start := time.Now()
			r, err := e.runScale(backend, n)
			if err != nil {
				return fmt.Errorf("%s, %d ranks: %w", backend, n, err)
			}
			fmt.Fprintf(os.Stderr, "%s %d ranks: %v\n", backend, n, time.Since(start).Round(time.Second))
			results = append(results, r)
		}
		printResults(os.Stdout, backend, cfg, results)
	}
	return nil
}

// result is what one backend at one rank count measured.
type result struct {
	ranks int
	steps []stepResult
	cli   []cliResult
	// the daemons' resident memory after the steps (sum), the largest
	// peak of one, and their file descriptors (sum)
	rss, peak int64
	fds       int
}

type stepResult struct {
	counts counts
	// times: the last Save call returned, every Wait returned, the last
	// manifest written, the commit record written
	lastSave, allWaits, lastManifest, commit time.Time
}

type cliResult struct {
	name   string
	counts counts
	took   time.Duration
}

func (e *env) storage(backend string) (string, []string, error) {
	switch backend {
	case "s3":
		return "s3://" + bucket + "/ckpt", []string{
			"AWS_ENDPOINT_URL=" + e.px.endpoint(), "AWS_ACCESS_KEY_ID=" + e.srv.AccessKey,
			"AWS_SECRET_ACCESS_KEY=" + e.srv.SecretKey, "AWS_REGION=" + miniotest.Region,
		}, nil
	case "posix":
		return filepath.Join(e.work, "posix"), nil, nil
	}
	return "", nil, fmt.Errorf("unknown backend %q (s3 or posix)", backend)
}

// runScale runs n ranks of a job of their own over fresh daemons, then
// the commands on what they saved.
func (e *env) runScale(backend string, n int) (*result, error) {
	storage, senv, err := e.storage(backend)
	if err != nil {
		return nil, err
	}
	job, attempt := fmt.Sprintf("scale-%05d", n), fmt.Sprintf("run-%d", n)
	ds, err := startDaemons(e.cfg, e.work, e.cfg.daemons, storage, job, senv)
	if err != nil {
		return nil, err
	}
	defer stopDaemons(ds)
	clients := make([]*ckptd.Client, n)
	for r := range clients {
		if clients[r], err = ckptd.Dial(ds[r%len(ds)].socket, ckptd.WithAttempt(attempt)); err != nil {
			return nil, err
		}
	}
	defer func() {
		for _, c := range clients {
			c.Close()
		}
	}()
	res := &result{ranks: n}
	data := make([]byte, e.cfg.shard)
	_, _ = rand.Read(data)
	for step := int64(1); step <= int64(e.cfg.steps); step++ {
		data[0] = byte(step)
		sr, err := e.runStep(backend, storage, clients, job, attempt, step, data)
		if err != nil {
			return nil, fmt.Errorf("step %d: %w", step, err)
		}
		res.steps = append(res.steps, sr)
		fmt.Fprintf(os.Stderr, "  %s %d ranks, step %d: manifest→COMMIT %v, save→COMMIT %v, save→all waits %v; %s\n",
			backend, n, step, sr.commit.Sub(sr.lastManifest).Round(time.Millisecond), sr.commit.Sub(sr.lastSave).Round(time.Millisecond),
			sr.allWaits.Sub(sr.lastSave).Round(time.Millisecond), byKind(sr.counts))
	}
	for _, d := range ds {
		cur, peak := d.rss()
		res.rss += cur
		res.peak = max(res.peak, peak)
		res.fds += d.fds()
	}
	stopDaemons(ds)
	ds = nil
	rank := strconv.Itoa(n - 1)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"list", []string{"list"}},
		{"restore --latest --rank R", []string{"restore", "--latest", "--rank", rank, "--out", filepath.Join(e.work, job+"-restore")}},
		{"verify --latest", []string{"verify", "--latest"}},
		{"prune --keep-last 2", []string{"prune", "--keep-last", "2"}},
	} {
		cr, err := e.command(c.name, storage, job, senv, c.args)
		if err != nil {
			return nil, err
		}
		res.cli = append(res.cli, cr)
	}
	return res, nil
}

// runStep has every rank save step and wait for its commit.
func (e *env) runStep(backend, storage string, clients []*ckptd.Client, job, attempt string, step int64, data []byte) (stepResult, error) {
	ctx, cancel := context.WithTimeout(e.ctx, e.cfg.timeout)
	defer cancel()
	var sr stepResult
	before := e.snapshot()
	var poll *posixPoller
	if backend == "posix" {
		poll = startPosixPoller(ctx, storage, job, attempt, step, len(clients))
	}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	for r, c := range clients {
		g.Go(func() error {
			h, err := c.Save(gctx, &ckptd.SaveRequest{
				Job: job, Step: step, Rank: r, WorldSize: len(clients),
				Tensors: []ckptd.Tensor{{Name: "w", DType: "U8", Shape: []int64{int64(len(data))}, Data: data}},
			})
			if err != nil {
				return fmt.Errorf("rank %d: save: %w", r, err)
			}
			now := time.Now()
			mu.Lock()
			if now.After(sr.lastSave) {
				sr.lastSave = now
			}
			mu.Unlock()
			if err := h.Wait(gctx); err != nil {
				return fmt.Errorf("rank %d: wait: %w", r, err)
			}
			now = time.Now()
			mu.Lock()
			if now.After(sr.allWaits) {
				sr.allWaits = now
			}
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return sr, err
	}
	switch backend {
	case "s3":
		// Each waiter has seen the commit record; what a daemon still does
		// after that (none reads storage) is left a moment to finish.
		time.Sleep(200 * time.Millisecond)
		st := e.px.times(job, step)
		sr.lastManifest, sr.commit = st.lastManifest, st.commit
	case "posix":
		sr.lastManifest, sr.commit = poll.wait()
	}
	sr.counts = e.snapshot().sub(before)
	if sr.commit.IsZero() {
		return sr, errors.New("every rank's wait returned, but no commit record was seen")
	}
	return sr, nil
}

func (e *env) snapshot() counts {
	if e.px == nil {
		return counts{}
	}
	return e.px.snapshot()
}

// command runs `ckptd <args> --storage storage --job job` and counts its
// requests.
func (e *env) command(name, storage, job string, senv, args []string) (cliResult, error) {
	ctx, cancel := context.WithTimeout(e.ctx, e.cfg.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, e.cfg.bin, append(args, "--storage", storage, "--job", job)...)
	cmd.Env = append(cleanEnv(), senv...)
	before := e.snapshot()
	start := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	if err != nil {
		return cliResult{}, fmt.Errorf("ckptd %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return cliResult{name: name, counts: e.snapshot().sub(before), took: took}, nil
}

// posixPoller watches a POSIX store for a step's manifests and commit
// record, every few milliseconds (these reads are not the daemons').
type posixPoller struct {
	done                 chan struct{}
	lastManifest, commit time.Time
}

func startPosixPoller(ctx context.Context, root, job, attempt string, step int64, ranks int) *posixPoller {
	p := &posixPoller{done: make(chan struct{})}
	stepDir := filepath.Join(root, job, "steps", fmt.Sprintf("%012d", step))
	go func() {
		defer close(p.done)
		for ctx.Err() == nil {
			now := time.Now()
			if p.lastManifest.IsZero() {
				ents, _ := os.ReadDir(filepath.Join(stepDir, attempt))
				n := 0
				for _, ent := range ents {
					if strings.HasSuffix(ent.Name(), ".manifest.json") {
						n++
					}
				}
				if n == ranks {
					p.lastManifest = now
				}
			}
			if _, err := os.Stat(filepath.Join(stepDir, "COMMIT.json")); err == nil {
				p.commit = now
				if p.lastManifest.IsZero() {
					p.lastManifest = now
				}
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	return p
}

func (p *posixPoller) wait() (lastManifest, commit time.Time) {
	<-p.done
	return p.lastManifest, p.commit
}
