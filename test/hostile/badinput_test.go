package hostile

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"slices"
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

// Every malformed request gets a clear error with the right code, and
// leaves storage untouched.
func TestBadRequestsChangeNothing(t *testing.T) {
	d := daemontest.Start(t, "", "--staging-bytes", "16MiB", "--staging-wait", "300ms")
	c := d.Client()
	api := c.API()
	ctx := daemontest.TestCtx(t)
	target := func(job string, step int64, rank, world int32) *pb.SaveTarget {
		return &pb.SaveTarget{Job: job, Step: step, Rank: rank, WorldSize: world, Attempt: daemontest.Attempt}
	}
	for _, tc := range []struct {
		name    string
		req     *pb.BeginSaveRequest
		code    codes.Code
		message string
	}{
		{"job with ..", &pb.BeginSaveRequest{Target: target("../etc", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 1)}}, codes.InvalidArgument, `"/" or ".."`},
		{"job with /", &pb.BeginSaveRequest{Target: target("a/b", 1, 0, 1)}, codes.InvalidArgument, `"/" or ".."`},
		{"job with NUL", &pb.BeginSaveRequest{Target: target("a\x00", 1, 0, 1)}, codes.InvalidArgument, "control byte"},
		{"long job", &pb.BeginSaveRequest{Target: target(strings.Repeat("j", 256), 1, 0, 1)}, codes.InvalidArgument, "more than 255"},
		{"tensor with ..", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("../x", 0, 1)}}, codes.InvalidArgument, "tensor name"},
		{"rank out of range", &pb.BeginSaveRequest{Target: target("", 1, 2, 2)}, codes.InvalidArgument, "rank 2 out of range"},
		{"negative step", &pb.BeginSaveRequest{Target: target("", -5, 0, 1)}, codes.InvalidArgument, "step -5"},
		{"overlap", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 4), daemontest.F32Tensor("b", 8, 4)}}, codes.InvalidArgument, "overlaps"},
		{"dtype x shape", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{{Name: "a", Dtype: "BF16", Shape: []int64{3}, Length: 12}}}, codes.InvalidArgument, "needs 6 bytes"},
		{"unknown dtype", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{{Name: "a", Dtype: "float32", Shape: []int64{1}, Length: 4}}}, codes.InvalidArgument, "unknown dtype"},
		{"huge offset", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 1<<63, 1)}}, codes.InvalidArgument, "negative offset"},
		{"larger than the arena", &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 8<<20)}}, codes.ResourceExhausted, "16777216"},
	} {
		_, err := api.BeginSave(ctx, tc.req)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.message) {
			t.Errorf("%s: %v; want %s containing %q", tc.name, err, tc.code, tc.message)
		}
	}

	// A full arena: hold 12 of 16 MiB, ask for 8 more.
	held, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 3<<20)}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target("", 2, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 2<<20)}})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "16777216") {
		t.Errorf("full arena: %v; want RESOURCE_EXHAUSTED naming the 16 MiB budget", err)
	}
	// The same rank twice while the first is staging.
	_, err = api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target("", 1, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 1)}})
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("second save of one rank: %v", err)
	}
	if _, err := api.AbortSave(ctx, &pb.AbortSaveRequest{LeaseId: held.GetLease().GetId()}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{held.GetLease().GetId(), "no-such-lease"} {
		if _, err := api.CommitSave(ctx, &pb.CommitSaveRequest{LeaseId: id}); status.Code(err) != codes.NotFound {
			t.Errorf("commit of released lease %q: %v", id, err)
		}
	}
	// A stream shorter than its table says.
	stream, _ := api.SaveStream(ctx)
	_ = stream.Send(&pb.SaveStreamRequest{Msg: &pb.SaveStreamRequest_Header{Header: &pb.SaveStreamHeader{
		Target: target("", 3, 0, 1), Tensors: []*pb.Tensor{daemontest.F32Tensor("a", 0, 100)}}}})
	_ = stream.Send(&pb.SaveStreamRequest{Msg: &pb.SaveStreamRequest_Data{Data: make([]byte, 10)}})
	if _, err := stream.CloseAndRecv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "ended before") {
		t.Errorf("short stream: %v", err)
	}

	// Restores of what does not exist.
	_, err = api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: 9000})
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "step 9000") {
		t.Errorf("unknown step: %v", err)
	}
	if _, err := c.Save(ctx, daemontest.Shard(5, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := c.Handle("", 5, 0).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: 9000})
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "latest committed step: 5") {
		t.Errorf("unknown step names the latest: %v", err)
	}
	if _, err := api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: 5, Rank: 1}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("rank beyond world size: %v", err)
	}
	if _, err := c.Save(ctx, daemontest.Shard(5, 0, 1)); status.Code(daemontest.UnwrapStatus(err)) != codes.AlreadyExists {
		t.Errorf("saving a committed step again: %v", err)
	}

	// Storage holds step 5 and nothing else.
	var names []string
	_ = filepath.Walk(d.Storage, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			rel, _ := filepath.Rel(d.Storage, p)
			names = append(names, rel)
		}
		return nil
	})
	want := "e2e/steps/000000000005/COMMIT.json e2e/steps/000000000005/run1/rank-00000.data e2e/steps/000000000005/run1/rank-00000.manifest.json"
	if strings.Join(names, " ") != want {
		t.Errorf("storage holds %v, want only step 5", names)
	}
}

func TestNoDaemonError(t *testing.T) {
	c, err := ckptd.Dial(filepath.Join(t.TempDir(), "nobody.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Steps(ctx, "")
	if err == nil || !strings.Contains(err.Error(), "nobody.sock") || !errors.Is(err, ckptd.ErrDaemonUnavailable) {
		t.Fatalf("no daemon: %v", err)
	}
	// Every command that talks to the daemon says so, and how to start one.
	sock := filepath.Join(t.TempDir(), "nobody.sock")
	for _, cmd := range [][]string{{"status"}, {"health"}, {"list", "--tiers"}} {
		_, stderr, err := daemontest.CLI(t, append(cmd, "--socket", sock)...)
		if err == nil || !strings.Contains(stderr, "no ckptd daemon answers on "+sock) || !strings.Contains(stderr, "ckptd serve --socket "+sock) {
			t.Errorf("ckptd %v with no daemon: %v\n%s", cmd, err, stderr)
		}
	}
}

func TestMetricsEndpoint(t *testing.T) {
	addr := daemontest.ClosedAddr(t) // free for the daemon to listen on
	d := daemontest.Start(t, "", "--metrics-addr", addr)
	c := d.Client()
	h, err := c.Save(daemontest.Ctx(t), daemontest.Shard(1, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	want := []string{"ckptd_staged_bytes_total 6.299864e+06", "ckptd_drained_bytes_total 6.299864e+06", "ckptd_save_stall_seconds_count 1",
		"ckptd_drain_seconds_count 1", "ckptd_drain_queue_depth 0", "ckptd_arena_used_bytes 0",
		`ckptd_last_committed_step{job="e2e"} 1`, `ckptd_last_commit_timestamp_seconds{job="e2e"} 1.`, `ckptd_build_info{goversion="go`, "ckptd_arena_locked "}
	// The save is reported committed before the drain gives its arena
	// region back: the gauges reach 0 a moment later.
	var body []byte
	testtime.Within(30*time.Second, func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		return !slices.ContainsFunc(want, func(m string) bool { return !strings.Contains(string(body), m) })
	})
	for _, m := range want {
		if !strings.Contains(string(body), m) {
			t.Errorf("metrics lack %q", m)
		}
	}
	// Every drained byte is counted under the codec its chunk got.
	var raw float64
	for line := range strings.Lines(string(body)) {
		if rest, ok := strings.CutPrefix(line, `ckptd_codec_raw_bytes_total{codec="`); ok {
			_, v, _ := strings.Cut(rest, "} ")
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("bad metric line %q", line)
			}
			raw += f
		}
	}
	if raw != 6299864 {
		t.Errorf("ckptd_codec_raw_bytes_total sums to %v, want the 6299864 bytes drained", raw)
	}
}

// --socket-group opens the socket and the arena (to map, so that group
// members get the zero-copy path too) to a group; an unknown group is a
// clear error before anything is created.
func TestSocketGroup(t *testing.T) {
	g, err := user.LookupGroupId(strconv.Itoa(os.Getgid()))
	if err != nil {
		t.Fatal(err)
	}
	d := daemontest.Start(t, "", "--socket-group", g.Name)
	for path, want := range map[string]os.FileMode{
		d.Socket:                        os.ModeSocket | 0o660,
		d.Arena:                         os.ModeDir | 0o750,
		filepath.Join(d.Arena, "arena"): 0o660,
	} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != want || int(fi.Sys().(*syscall.Stat_t).Gid) != os.Getgid() {
			t.Errorf("%s: mode %v gid %d, want %v gid %d", path, fi.Mode(), fi.Sys().(*syscall.Stat_t).Gid, want, os.Getgid())
		}
	}
	if _, err := d.Client().Save(daemontest.Ctx(t), daemontest.Shard(1, 0, 1)); err != nil {
		t.Fatal(err)
	}
	if err := daemontest.WaitStep(t, d.Client(), 1, 0); err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	_, stderr, err := daemontest.CLI(t, "serve", "--socket", filepath.Join(dir, "s.sock"), "--storage", filepath.Join(dir, "store"),
		"--arena-dir", filepath.Join(dir, "arena"), "--socket-group", "no-such-group-ckptd")
	if err == nil || !strings.Contains(stderr, `--socket-group "no-such-group-ckptd": no such group`) {
		t.Fatalf("unknown group: %v, %s", err, stderr)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("a refused serve left %d entries behind", len(entries))
	}
}
