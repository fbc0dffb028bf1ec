package ops

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// `ckptd health`, /healthz and /readyz: ready while storage answers, not
// ready while it does not, ready again once it is back.
func TestHealth(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	addr := daemontest.ClosedAddr(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--metrics-addr", addr, "--s3-retry-deadline", "1s")
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	health := func() (string, error) {
		out, stderr, err := daemontest.CLI(t, "health", "--socket", d.Socket)
		return out + stderr, err
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if !testtime.Within(time.Minute, cond) {
			t.Fatalf("%s: not within %v\n%s", what, testtime.Scale(time.Minute), d.Logs())
		}
	}
	if out, err := health(); err != nil || !strings.Contains(out, "serving") {
		t.Fatalf("ckptd health on a ready daemon: %v %s", err, out)
	}
	if code, body := get("/readyz"); code != 200 {
		t.Fatalf("/readyz: %d %s", code, body)
	}
	srv.Kill()
	waitFor("/readyz turns unready", func() bool { code, _ := get("/readyz"); return code == 503 })
	if code, _ := get("/healthz"); code != 200 {
		t.Fatalf("/healthz while storage is down: %d (the process is alive)", code)
	}
	waitFor("ckptd health fails", func() bool { _, err := health(); return err != nil })
	// It names what fails, as /readyz does: the storage and why.
	if out, _ := health(); !strings.Contains(out, "NOT_SERVING") || !strings.Contains(out, "does not answer") || !strings.Contains(out, "s3://") {
		t.Errorf("ckptd health with storage down says: %s", out)
	}
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor("ready again", func() bool { code, _ := get("/readyz"); _, err := health(); return code == 200 && err == nil })
}

// --log-format json writes one JSON object per line, the first naming the
// version, with one line per save carrying the stable keys.
func TestJSONLogs(t *testing.T) {
	d := daemontest.Start(t, "", "--log-format", "json")
	daemontest.SaveAndWait(t, d.Client(), daemontest.Shard(1, 0, 1))
	d.Stop()
	var saves int
	for i, line := range slices.Collect(strings.Lines(d.Logs())) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("not a JSON line: %q: %v", line, err)
		}
		if v, _ := rec["version"].(string); i == 0 && (rec["msg"] != "ckptd starting" || v == "") {
			t.Errorf("the first line does not name the version: %s", line)
		}
		if rec["msg"] == "save durable" {
			saves++
			for _, k := range []string{"job", "step", "rank", "attempt", "bytes", "duration"} {
				if _, ok := rec[k]; !ok {
					t.Errorf("the save line lacks %q: %s", k, line)
				}
			}
			// Seconds, not nanoseconds: a drain of 6 MB takes well under a minute.
			if d, ok := rec["duration"].(float64); !ok || d <= 0 || d > 60 {
				t.Errorf("the save line's duration is not in seconds: %v", rec["duration"])
			}
		}
	}
	if saves != 1 {
		t.Fatalf("%d save lines for one save:\n%s", saves, d.Logs())
	}
}

// A CLI command against a store that does not answer fails within its
// short default deadline, in one line, not one warning per retry.
func TestCLIDeadStoreFailsFast(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	env := daemontest.WithoutEndpoint(srv.Env())
	env = append(env, "AWS_ENDPOINT_URL=http://"+daemontest.ClosedAddr(t))
	start := time.Now()
	_, stderr, err := daemontest.CLIEnv(t, env, "list", "--storage", store, "--job", "e2e")
	took := time.Since(start)
	if err == nil || took > testtime.Scale(45*time.Second) {
		t.Fatalf("list against a dead store: %v after %s", err, took)
	}
	if lines := strings.Count(strings.TrimSpace(stderr), "\n") + 1; lines != 1 {
		t.Fatalf("%d lines of stderr, want one:\n%s", lines, stderr)
	}
}

// `ckptd status` shows what the daemon holds: a journaled save waiting for
// its drain, an open save lease with its owner, the arena's use by kind;
// as a table and as JSON.
func TestStatus(t *testing.T) {
	d := daemontest.Start(t, "", "--debug-drain-delay", "1h", "--shutdown-grace", "100ms")
	c := d.Client()
	if _, err := c.Save(daemontest.Ctx(t), daemontest.Shard(7, 0, 2)); err != nil {
		t.Fatal(err)
	}
	att := c.Attempt()
	open, err := c.API().BeginSave(daemontest.Ctx(t), &pb.BeginSaveRequest{
		Target: &pb.SaveTarget{Step: 8, WorldSize: 1, Attempt: att}, Tensors: []*pb.Tensor{daemontest.F32Tensor("w", 0, 1024)}})
	if err != nil {
		t.Fatal(err)
	}
	st := daemontest.StatusJSON(t, d.Socket)
	// 64-bit integers are JSON numbers, not protojson's strings.
	raw, _, err := daemontest.CLI(t, "status", "--socket", d.Socket, "--json")
	if err != nil || !strings.Contains(raw, `"size": 268435456`) || !strings.Contains(raw, `"step": 7`) {
		t.Fatalf("status --json: want numbers for 64-bit fields (%v):\n%s", err, raw)
	}
	a := st.GetArena()
	if !st.GetStorageReady() || a.GetSize() != 256<<20 || a.GetStaging() == 0 || a.GetUsed() < a.GetStaging() {
		t.Fatalf("status: ready %v, arena %v", st.GetStorageReady(), a)
	}
	states := map[int64]string{}
	for _, s := range st.GetSaves() {
		states[s.GetTarget().GetStep()] = s.GetState()
		if s.GetAgeSeconds() < s.GetSecondsInState() || s.GetAgeSeconds() <= 0 {
			t.Errorf("save %v: age %v, in its state %v: want an age covering the time in state", s.GetTarget(), s.GetAgeSeconds(), s.GetSecondsInState())
		}
	}
	if (states[7] != "staged" && states[7] != "draining") || states[8] != "staging" {
		t.Fatalf("save states %v: want step 7 staged or draining, step 8 staging", states)
	}
	me := fmt.Sprintf("uid %d pid %d", os.Getuid(), os.Getpid())
	var journaled, leased bool
	for _, l := range st.GetLeases() {
		if l.GetPeer() != me || len(l.GetIdPrefix()) >= len(open.GetLease().GetId()) {
			t.Fatalf("lease %v: want peer %q and a short id prefix", l, me)
		}
		journaled = journaled || l.GetJournaled() && l.GetTarget().GetStep() == 7
		leased = leased || !l.GetJournaled() && l.GetTarget().GetStep() == 8 && l.GetExpiresInSeconds() > 0
	}
	if !journaled || !leased {
		t.Fatalf("leases %v: want step 7 journaled and step 8 open", st.GetLeases())
	}
	out, stderr, err := daemontest.CLI(t, "status", "--socket", d.Socket)
	if err != nil {
		t.Fatalf("ckptd status: %v\n%s", err, stderr)
	}
	for _, want := range []string{"storage", "ready", "SAVES (2)", "AGE", "LEASES (2)", "DATASETS (0)", me, "staging"} {
		if !strings.Contains(out, want) {
			t.Fatalf("ckptd status lacks %q:\n%s", want, out)
		}
	}
}

// serve --nice N runs every thread of the daemon N nice levels below the
// test's own, so that a trainer beside it wins a contended core.
func TestServeNice(t *testing.T) {
	own, err := unix.Getpriority(unix.PRIO_PROCESS, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := min(20-own+7, 19)
	d := daemontest.Start(t, t.TempDir(), "--nice", "7")
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", d.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tasks {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", d.Cmd.Process.Pid, e.Name()))
		if err != nil {
			continue // a thread gone meanwhile
		}
		// Field 19 is nice; the name in field 2 is in parentheses and may hold spaces.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if nice, err := strconv.Atoi(fields[16]); err != nil || nice != want {
			t.Errorf("thread %s runs at nice %s; want %d", e.Name(), fields[16], want)
		}
	}
}

// ckptd status counts failed operations by backend: none while the store
// answers (the readiness probe's "not found" is an answer), the checkpoint
// store's and a dataset source's once MinIO is gone; as JSON and in the
// table.
func TestStatusBackendErrors(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	source := "s3://" + bucket + "/ds"
	addr := daemontest.ClosedAddr(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--s3-retry-deadline", "1s", "--dataset-allow", source, "--metrics-addr", addr)
	c := d.Client()
	daemontest.SaveAndWait(t, c, daemontest.Shard(1, 0, 1))
	if got := daemontest.StatusJSON(t, d.Socket).GetBackendErrors(); !maps.Equal(got, map[string]uint64{"store": 0, "dataset": 0}) {
		t.Fatalf("backend errors %v while storage answers, want store 0, dataset 0", got)
	}
	srv.Kill()
	if _, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: source, BatchSize: 1, WorldSize: 1}); err == nil {
		t.Fatal("a dataset on a dead store opened")
	}
	var errs map[string]uint64
	var ready bool
	if !testtime.Within(time.Minute, func() bool {
		st := daemontest.StatusJSON(t, d.Socket) // asks storage again once the last probe is 5s old
		errs, ready = st.GetBackendErrors(), st.GetStorageReady()
		return !ready && errs["store"] > 0
	}) {
		t.Fatalf("backend errors %v, storage ready %v %v into the outage\n%s", errs, ready, testtime.Scale(time.Minute), d.Logs())
	}
	if errs["dataset"] == 0 {
		t.Fatalf("backend errors %v: the dataset source's failed listing is not counted", errs)
	}
	out, stderr, err := daemontest.CLI(t, "status", "--socket", d.Socket)
	if err != nil {
		t.Fatalf("ckptd status: %v\n%s", err, stderr)
	}
	line := regexp.MustCompile(`(?m)^backend errors +store (\d+), dataset (\d+)$`).FindStringSubmatch(out)
	if line == nil || line[1] == "0" || line[2] == "0" {
		t.Fatalf("ckptd status: no backend errors line counting store and dataset failures:\n%s", out)
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	metrics, _ := io.ReadAll(resp.Body)
	for _, want := range []string{`ckptd_backend_errors_total{backend="store",op="stat"}`, `ckptd_backend_errors_total{backend="dataset",op="open"}`} {
		if !bytes.Contains(metrics, []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// ckptd status --watch redraws until interrupted, and each frame shows
// the daemon as it is then.
func TestStatusWatch(t *testing.T) {
	d := daemontest.Start(t, "")
	cmd := daemontest.Command(daemontest.Bin(t), "status", "--socket", d.Socket, "--watch", "200ms")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	frames := watchFrames(stdout)
	next := func(want string) string {
		t.Helper()
		timeout := time.After(testtime.Scale(time.Minute))
		for {
			select {
			case f, ok := <-frames:
				if !ok {
					t.Fatalf("ckptd status --watch ended before a frame with %q\n%s", want, stderr.String())
				}
				if strings.Contains(f, want) {
					return f
				}
			case <-timeout:
				t.Fatalf("no frame with %q within %v", want, testtime.Scale(time.Minute))
			}
		}
	}
	next("LEASES (0)")
	c := d.Client()
	if _, err := c.API().BeginSave(daemontest.Ctx(t), &pb.BeginSaveRequest{
		Target: &pb.SaveTarget{Step: 1, WorldSize: 1, Attempt: c.Attempt()}, Tensors: []*pb.Tensor{daemontest.F32Tensor("w", 0, 1024)}}); err != nil {
		t.Fatal(err)
	}
	next("LEASES (1)")
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	for range frames { // to the end of its output
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("ckptd status --watch after an interrupt: %v (the way to end it)\n%s", err, stderr.String())
	}
}

// watchFrames splits --watch's output into the frames between its
// clear-screen sequences.
func watchFrames(r io.Reader) <-chan string {
	// Into a pipe, a frame begins with a "--- <time>" line, no escape
	// codes (those are for a terminal only).
	sep := []byte("--- ")
	sc := bufio.NewScanner(r)
	sc.Split(func(data []byte, atEOF bool) (int, []byte, error) {
		if bytes.Contains(data, []byte("\033")) {
			return 0, nil, fmt.Errorf("an escape code in --watch's output to a pipe: %q", data)
		}
		if i := bytes.Index(data, sep); i >= 0 {
			if j := bytes.IndexByte(data[i:], '\n'); j >= 0 {
				return i + j + 1, data[:i], nil
			}
		}
		if atEOF && len(data) > 0 {
			return len(data), data, nil
		}
		return 0, nil, nil
	})
	frames := make(chan string)
	go func() {
		defer close(frames)
		for sc.Scan() {
			if f := sc.Text(); f != "" {
				frames <- f
			}
		}
	}()
	return frames
}

// ckptd list --jobs lists the jobs a daemon saved to a store, on a folder
// and on S3, as lines and as JSON; a folder without steps is no job.
func TestListJobs(t *testing.T) {
	t.Run("posix", func(t *testing.T) {
		store := filepath.Join(t.TempDir(), "store")
		if err := os.MkdirAll(filepath.Join(store, "notes"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(store, "notes", "README"), []byte("not a job"), 0o644); err != nil {
			t.Fatal(err)
		}
		checkListJobs(t, store, nil)
	})
	t.Run("s3", func(t *testing.T) {
		srv, _, store := daemontest.S3Store(t)
		checkListJobs(t, store, srv.Env())
	})
}

func checkListJobs(t *testing.T, store string, env []string) {
	d := daemontest.StartEnv(t, store, env)
	c := d.Client()
	jobs := []string{"train-b", "train-a"}
	for _, job := range jobs {
		r := daemontest.Shard(1, 0, 1)
		r.Job = job
		daemontest.SaveAndWait(t, c, r)
	}
	slices.Sort(jobs)
	out, stderr, err := daemontest.CLIEnv(t, env, "list", "--jobs", "--storage", store)
	if err != nil || out != strings.Join(jobs, "\n")+"\n" {
		t.Fatalf("ckptd list --jobs: %v %q, want %q\n%s", err, out, jobs, stderr)
	}
	out, stderr, err = daemontest.CLIEnv(t, env, "list", "--jobs", "--json", "--storage", store)
	var got []string
	if err != nil || json.Unmarshal([]byte(out), &got) != nil || !slices.Equal(got, jobs) {
		t.Fatalf("ckptd list --jobs --json: %v %q, want %q\n%s", err, out, jobs, stderr)
	}
}

// A mistyped command names every command there is.
func TestUnknownCommandListsCommands(t *testing.T) {
	_, stderr, err := daemontest.CLI(t, "stauts")
	if code := daemontest.ExitCode(err); code != 2 {
		t.Fatalf("ckptd stauts: exit %d (%v), want 2\n%s", code, err, stderr)
	}
	for _, want := range []string{"did you mean status?", "export", "health", "list", "prune", "restore", "serve", "status", "verify"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("the message lacks %q: %s", want, stderr)
		}
	}
}

// A replica that cannot reach its peer counts as a peers error in ckptd
// status (0 before: the key is there whenever peers are configured).
func TestStatusPeerErrors(t *testing.T) {
	self, dead := daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)
	d := daemontest.Start(t, "", "--hot-bytes", "64MiB", "--peers", self+","+dead, "--peer-listen", self, "--peer-insecure")
	if got := daemontest.StatusJSON(t, d.Socket).GetBackendErrors(); !maps.Equal(got, map[string]uint64{"store": 0, "dataset": 0, "peers": 0}) {
		t.Fatalf("backend errors %v before any transfer, want store, dataset and peers 0", got)
	}
	daemontest.SaveAndWait(t, d.Client(), daemontest.Shard(1, 0, 1)) // its replica goes to the dead peer
	var errs map[string]uint64
	if !testtime.Within(time.Minute, func() bool {
		errs = daemontest.StatusJSON(t, d.Socket).GetBackendErrors()
		return errs["peers"] > 0
	}) {
		t.Fatalf("backend errors %v %v after a replica to a dead peer\n%s", errs, testtime.Scale(time.Minute), d.Logs())
	}
	if errs["store"] != 0 || !strings.Contains(d.Logs(), "replicating to peers failed") {
		t.Fatalf("backend errors %v: want peers only, from the failed replica\n%s", errs, d.Logs())
	}
}
