package hostile

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// The hostile-client suite: every request a buggy or malicious client can
// send, and every way a client can die, against a real `ckptd serve` built
// without the race detector (so its memory is what production sees), run
// under a hard memory limit (RLIMIT_DATA, hostileDataLimit): an attack
// that made it allocate past the limit would kill it. After each attack
// the daemon is alive, the peak of its anonymous memory stays under its
// budgets plus a fixed margin, the attacker got a clear gRPC error, and a
// step committed before the attack restores byte-exact.

const (
	hostileStaging = 64 << 20
	hostileTables  = 32 << 20
	// hostileMargin is what the daemon may hold beyond its budgets: the Go
	// runtime, gRPC's buffers, requests being decoded, and garbage the
	// collector has not returned to the kernel yet.
	hostileMargin = 160 << 20
	// hostileDataLimit is the daemon's RLIMIT_DATA. It counts the private
	// writable memory the daemon maps, not what it touches: the Go
	// runtime maps its heap in 64 MiB arenas, and measured 170-260 MiB
	// mapped through these attacks, against 100-130 MiB resident. The
	// arena is shared memory, not counted.
	hostileDataLimit = 512 << 20
)

type hostile struct {
	*daemontest.Daemon
	metrics string
	good    *ckptd.SaveRequest
	data    string // a dataset folder the daemon allows
}

func startHostile(t *testing.T) *hostile {
	t.Helper()
	addr := daemontest.ClosedAddr(t)
	data := t.TempDir()
	daemontest.WriteShards(t, data, 8, 32)
	d := daemontest.New(t, "", "", "--staging-bytes", strconv.Itoa(hostileStaging), "--tensor-table-bytes", strconv.Itoa(hostileTables),
		"--staging-wait", "200ms", "--job", "e2e", "--metrics-addr", addr, "--dataset-allow", data, "--slot-bytes", "1MiB")
	d.Bin, d.DataLimit = daemontest.PlainBin(t), hostileDataLimit
	h := &hostile{Daemon: d, metrics: "http://" + addr + "/metrics", good: daemontest.Shard(1, 0, 1), data: data}
	d.Start()
	c := d.Client()
	hd, err := c.Save(daemontest.Ctx(t), h.good)
	if err != nil {
		t.Fatal(err)
	}
	if err := hd.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	return h
}

// check asserts the daemon survived an attack intact.
func (h *hostile) check(t *testing.T, attack string) {
	t.Helper()
	select {
	case <-h.Exited():
		t.Fatalf("%s: the daemon died:\n%s", attack, h.Logs())
	default:
	}
	anon, peak := rssAnon(t, h.Cmd.Process.Pid)
	t.Logf("%s: daemon alive, %d MiB anonymous memory, peak %d MiB", attack, anon>>20, peak>>20)
	if peak > hostileTables+hostileMargin {
		t.Errorf("%s: the daemon's anonymous memory peaked at %d MiB, more than its %d MiB table budget plus a %d MiB margin",
			attack, peak>>20, hostileTables>>20, hostileMargin>>20)
	}
	got, err := h.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if err != nil {
		t.Fatalf("%s: the good step no longer restores: %v", attack, err)
	}
	daemontest.CheckShard(t, got, h.good)
}

// rssAnon is a process's resident anonymous memory (its heap and stacks;
// the shared-memory arena is not counted), now and at its peak. The
// kernel keeps the peak of the whole resident set only (VmHWM): the peak
// here is that less the shared memory and file pages resident now, which
// the arena (mlocked, so constant) and the binary account for.
func rssAnon(t *testing.T, pid int) (now, peak int64) {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	kb := map[string]int64{}
	for line := range strings.Lines(string(data)) {
		if name, rest, ok := strings.Cut(line, ":"); ok && strings.HasSuffix(rest, " kB\n") {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			kb[name] = n << 10
		}
	}
	if _, ok := kb["RssAnon"]; !ok {
		t.Fatal("no RssAnon")
	}
	return kb["RssAnon"], max(kb["RssAnon"], kb["VmHWM"]-kb["RssShmem"]-kb["RssFile"])
}

func (h *hostile) metric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get(h.metrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for line := range strings.Lines(string(body)) {
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			v, _ := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v
		}
	}
	return 0
}

func wantCode(t *testing.T, attack string, err error, code codes.Code, reason string) {
	t.Helper()
	if status.Code(err) != code || ckptd.Reason(err) != reason {
		t.Errorf("%s: got %v (reason %q), want %s with reason %s", attack, err, ckptd.Reason(err), code, reason)
	}
}

func target(step int64) *pb.SaveTarget {
	return &pb.SaveTarget{Step: step, WorldSize: 1, Attempt: daemontest.Attempt}
}

func TestHostileRequests(t *testing.T) {
	h := startHostile(t)
	api := h.Client().API()
	ctx := daemontest.TestCtx(t)

	// 2^62 bytes at offset 2^62: the region's end wraps past int64.
	_, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(2), Tensors: []*pb.Tensor{
		{Name: "a", Dtype: "U8", Shape: []int64{1 << 62}, Offset: 1 << 62, Length: 1 << 62},
		{Name: "b", Dtype: "U8", Shape: []int64{1 << 62}, Offset: 3 << 61, Length: 1 << 62}}})
	wantCode(t, "2^62 overflow", err, codes.InvalidArgument, "INVALID")
	h.check(t, "2^62 overflow")

	_, err = api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(2), Tensors: []*pb.Tensor{daemontest.F32Tensor("__metadata__", 0, 1)}})
	wantCode(t, "__metadata__ tensor", err, codes.InvalidArgument, "INVALID")
	for _, a := range []string{"", "Upper", "../x", ".", "..", "a/b", strings.Repeat("a", 65)} {
		_, err = api.BeginSave(ctx, &pb.BeginSaveRequest{Target: &pb.SaveTarget{Step: 2, WorldSize: 1, Attempt: a},
			Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 1)}})
		wantCode(t, fmt.Sprintf("attempt %q", a), err, codes.InvalidArgument, "INVALID")
	}

	lease, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(3), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = api.CommitSave(ctx, &pb.CommitSaveRequest{LeaseId: lease.GetLease().GetId(), Metadata: make([]byte, 9<<20)})
	wantCode(t, "9 MiB of metadata", err, codes.InvalidArgument, "INVALID")
	real := lease.GetLease().GetId()
	neighbour := real[:31] + map[bool]string{true: "1", false: "0"}[real[31] == '0'] // differs in the last digit
	for _, id := range []string{"00000000000000000000000000000000", neighbour, "../../journal"} {
		_, err = api.CommitSave(ctx, &pb.CommitSaveRequest{LeaseId: id})
		wantCode(t, "guessed lease id "+id, err, codes.NotFound, "UNKNOWN_LEASE")
	}
	h.check(t, "bad leases and metadata")

	// Tensor tables of 100k tensors each, held open: the table budget
	// refuses them before they fill the daemon's memory.
	big := make([]*pb.Tensor, 100_000)
	for i := range big {
		big[i] = &pb.Tensor{Name: fmt.Sprintf("t%06d", i), Dtype: "U8", Shape: []int64{0}}
	}
	var refused int
	for i := range 20 {
		_, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(int64(100 + i)), Tensors: big})
		if err != nil {
			wantCode(t, "100k-tensor tables", err, codes.ResourceExhausted, "OVER_BUDGET")
			refused++
		}
	}
	if refused == 0 {
		t.Error("20 tables of 100k tensors all held open: no budget")
	}
	if used := h.metric(t, "ckptd_tensor_table_bytes"); used > hostileTables {
		t.Errorf("open tables book %v bytes, over the %d budget", used, hostileTables)
	}
	h.check(t, "100k-tensor tables")
}

// A trainer killed between BeginSave and CommitSave, or while holding
// restore regions, frees them within seconds, and its restart re-saves
// the same rank.
func TestDeadClientFrees(t *testing.T) {
	h := startHostile(t)
	for _, act := range []string{"hold-save", "hold-restores", "hold-dataset"} {
		t.Run(act, func(t *testing.T) {
			proc, err := holdAndWait(t, h.Socket, act, "CKPTD_TEST_DATA="+h.data)
			if err != nil {
				t.Fatal(err)
			}
			held := func() float64 {
				a := daemontest.StatusJSON(t, h.Socket).GetArena()
				return float64(a.GetStaging()+a.GetRestores()+a.GetDatasets()) + h.metric(t, "ckptd_prefetch_sessions")
			}
			if used := held(); used < 1<<20 {
				t.Fatalf("the client holds only %v bytes", used)
			}
			_ = proc.Process.Signal(syscall.SIGKILL)
			_ = proc.Wait()
			if !testtime.Within(10*time.Second, func() bool { return held() == 0 }) {
				t.Fatalf("the dead client's regions or sessions are still held after %v:\n%s", testtime.Scale(10*time.Second), h.Logs())
			}
			// The restarted trainer saves the same rank of the same step.
			big := daemontest.Shard(2, 0, 1)
			big.Tensors[0].Data = make([]byte, 48<<20)
			big.Tensors[0].Shape = []int64{12 << 20}
			if act == "hold-save" {
				hd, err := h.Client().Save(daemontest.Ctx(t), big)
				if err != nil {
					t.Fatalf("re-save after the trainer died: %v", err)
				}
				if err := hd.Wait(daemontest.Ctx(t)); err != nil {
					t.Fatal(err)
				}
			}
			h.check(t, act)
		})
	}
}

// holdAndWait starts a client process that takes arena space and waits
// to be killed; it returns once the space is held.
func holdAndWait(t *testing.T, socket, act string, env ...string) (*exec.Cmd, error) {
	t.Helper()
	cmd := daemontest.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "CKPTD_TEST_ACT="+act, "CKPTD_TEST_SOCKET="+socket), env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, _ := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "held") {
		return nil, fmt.Errorf("%s: %q", act, line)
	}
	return cmd, nil
}

// holdAct is the client side of holdAndWait.
func holdAct(ctx context.Context, c *ckptd.Client, act string) error {
	api := c.API()
	switch act {
	case "hold-save":
		_, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(2), Tensors: []*pb.Tensor{{Name: "w", Dtype: "U8", Shape: []int64{48 << 20}, Length: 48 << 20}}})
		if err != nil {
			return err
		}
	case "hold-restores":
		for range 6 {
			if _, err := api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: 1}); err != nil {
				return err
			}
		}
	case "hold-dataset": // a consumer holding a batch and its ring
		ds, err := c.Dataset(ctx, &ckptd.DatasetRequest{Source: os.Getenv("CKPTD_TEST_DATA"), BatchSize: 8, WorldSize: 1})
		if err != nil {
			return err
		}
		if _, err := ds.Next(ctx); err != nil {
			return err
		}
	}
	fmt.Println("held")
	time.Sleep(time.Hour)
	return nil
}

// A journal entry that would crash the daemon (a crafted 2^62 table, as
// an older daemon may have journaled) is set aside at start, not replayed
// into a crash loop.
func TestPoisonedJournalQuarantined(t *testing.T) {
	h := startHostile(t)
	h.Stop()
	entry := `{"lease":"poison","offset":0,"length":0,"target":{"Job":"e2e","Step":5,"Rank":0,"WorldSize":1,"Attempt":"run1"},` +
		`"tensors":[{"name":"a","dtype":"U8","shape":[4611686018427387904],"offset":4611686018427387904,"length":4611686018427387904},` +
		`{"name":"b","dtype":"U8","shape":[4611686018427387904],"offset":6917529027641081856,"length":4611686018427387904}],"metadata":null,"staged_at":"2026-01-01T00:00:00Z"}`
	if err := os.MkdirAll(filepath.Join(h.Arena, "journal"), 0o700); err != nil { // a clean stop removed the arena
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(h.Arena, "journal", "poison"), []byte(entry), 0o600); err != nil {
		t.Fatal(err)
	}
	h.Start()
	h.check(t, "poisoned journal")
	if h.metric(t, "ckptd_journal_quarantined_total") != 1 || !strings.Contains(h.Logs(), "journal entry unusable; set aside") {
		t.Fatalf("the poisoned entry was not set aside:\n%s", h.Logs())
	}
	h.Kill9()
	h.Start() // and again: it must not come back
	h.check(t, "restart after the quarantine")
	if n := strings.Count(h.Logs(), "journal entry unusable"); n != 1 {
		t.Fatalf("the poisoned entry came back (%d times):\n%s", n, h.Logs())
	}
}

// A damaged commit record of a newer step does not hide the older ones.
func TestDamagedCommitRecord(t *testing.T) {
	h := startHostile(t)
	c := h.Client()
	hd, err := c.Save(daemontest.Ctx(t), daemontest.Shard(2, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := hd.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	commit := filepath.Join(h.Storage, "e2e/steps/000000000002/COMMIT.json")
	data, _ := os.ReadFile(commit)
	if err := os.WriteFile(commit, data[:len(data)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	steps, err := c.Steps(daemontest.Ctx(t), "")
	if err != nil || len(steps) != 1 || steps[0].Step != 1 {
		t.Fatalf("Steps with a damaged newer record = %+v, %v", steps, err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true})
	if err != nil || got.Step != 1 {
		t.Fatalf("load latest: %v", err)
	}
	out, stderr, err := daemontest.CLI(t, "list", "--storage", h.Storage, "--job", "e2e")
	if err != nil || !strings.Contains(stderr, "step=2") || !bytes.Contains([]byte(out), []byte("\n1 ")) {
		t.Fatalf("list: %v\n%s\n%s", err, out, stderr)
	}
	h.check(t, "damaged commit record")
}

// A damaged manifest of the newest step: ckptd restore --latest and prune
// skip that step naming it; a trainer's load of latest for the damaged
// rank fails with DATA_LOSS saying why it does not fall back (its other
// ranks would restore the newer step), while a load of the good rank and
// of the step before still work.
func TestDamagedManifest(t *testing.T) {
	h := startHostile(t)
	c := h.Client()
	for _, step := range []int64{2, 3} {
		daemontest.SaveAndWait(t, c, daemontest.Shard(step, 0, 2), daemontest.Shard(step, 1, 2))
	}
	manifest := filepath.Join(h.Storage, "e2e/steps/000000000003", daemontest.Attempt, "rank-00001.manifest.json")
	if err := os.Truncate(manifest, 100); err != nil {
		t.Fatal(err)
	}
	_, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: 1})
	wantCode(t, "load latest of the damaged rank", err, codes.DataLoss, "CORRUPT")
	if err == nil || !strings.Contains(err.Error(), "does not fall back") {
		t.Fatalf("load latest of the damaged rank: %v", err)
	}
	if got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Rank: 0}); err != nil || got.Step != 3 {
		t.Fatalf("load latest of the good rank: %v", err)
	}
	out := t.TempDir()
	_, stderr, err := daemontest.CLI(t, "restore", "--storage", h.Storage, "--job", "e2e", "--latest", "--out", out)
	if err != nil || !strings.Contains(stderr, "step=3") {
		t.Fatalf("restore --latest past a damaged manifest: %v\n%s", err, stderr)
	}
	if meta, err := os.ReadFile(filepath.Join(out, "metadata.json")); err != nil || !strings.Contains(string(meta), `"step": 2`) {
		t.Fatalf("restore --latest restored %s, %v; want step 2", meta, err)
	}
	// One rank, as a trainer loads it: the newest step from its commit
	// record and that rank's manifest alone, which a job of thousands of
	// ranks needs; the damaged rank says so instead of falling back.
	one := t.TempDir()
	if _, stderr, err := daemontest.CLI(t, "restore", "--storage", h.Storage, "--job", "e2e", "--latest", "--rank", "0", "--out", one); err != nil {
		t.Fatalf("restore --latest --rank 0 past another rank's damaged manifest: %v\n%s", err, stderr)
	}
	if meta, err := os.ReadFile(filepath.Join(one, "metadata.json")); err != nil || !strings.Contains(string(meta), `"step": 3`) {
		t.Fatalf("restore --latest --rank 0 restored %s, %v; want step 3", meta, err)
	}
	if _, stderr, err := daemontest.CLI(t, "restore", "--storage", h.Storage, "--job", "e2e", "--latest", "--rank", "1", "--out", t.TempDir()); err == nil ||
		!strings.Contains(stderr, "corrupt") {
		t.Fatalf("restore --latest --rank 1 of the damaged manifest: %v\n%s", err, stderr)
	}
	stdout, stderr, err := daemontest.CLI(t, "prune", "--storage", h.Storage, "--job", "e2e", "--keep-last", "3")
	if err != nil || !strings.Contains(stdout, "left alone: steps [3]") {
		t.Fatalf("prune with a damaged kept manifest: %v\n%s%s", err, stdout, stderr)
	}
	h.check(t, "damaged manifest")
}

// Restore leases of a tensor-less step take no arena space; each books a
// fixed cost of --tensor-table-bytes instead, so a client calling
// BeginRestore in a loop is refused with OVER_BUDGET, and its connection's
// end gives the budget back.
func TestRestoreLeasesAreBounded(t *testing.T) {
	d := daemontest.Start(t, "", "--tensor-table-bytes", "64KiB")
	c := d.Client()
	empty := &ckptd.SaveRequest{Step: 1, WorldSize: 1, Tensors: []ckptd.Tensor{{Name: "e", DType: "F32", Shape: []int64{0}}}}
	daemontest.SaveAndWait(t, c, empty)
	hog, err := ckptd.Dial(d.Socket, ckptd.WithAttempt(daemontest.Attempt))
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for ; held < 1000; held++ {
		if _, err = hog.API().BeginRestore(daemontest.Ctx(t), &pb.BeginRestoreRequest{Step: 1}); err != nil {
			break
		}
	}
	wantCode(t, "restore leases of an empty step", err, codes.ResourceExhausted, "OVER_BUDGET")
	if held == 0 || held > 64 {
		t.Fatalf("%d restore leases held before the refusal; want some, at most 64 KiB / 1 KiB", held)
	}
	hog.Close()
	testtime.Until(t, 10*time.Second, "the closed connection's restore leases give the budget back", func() bool {
		_, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
		return err == nil
	})
}
