package hostile

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// The trust tests play a second local user: the test binary runs itself
// as uid 65534 (nobody) with a chosen group, and reports what that user
// could do. They need root, as CI's containers have.

const (
	otherUID = 65534
	// shareGID is a group with no name that only the test's other user
	// is made a member of.
	shareGID = 23456
)

// actAsOther runs one action (see runAct) as uid 65534 with the given
// supplementary groups and returns its one-line report.
func actAsOther(t *testing.T, groups []uint32, env ...string) string {
	t.Helper()
	cmd := otherCommand(t, groups, env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as uid %d: %v\n%s", otherUID, err, out)
	}
	return strings.TrimSpace(string(out))
}

// otherCommand is the test binary as uid 65534 with groups, to run a
// helper action (CKPTD_TEST_ACT in env).
func otherCommand(t *testing.T, groups []uint32, env ...string) *exec.Cmd {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("the trust tests need root (to play another user) and CI runs as root")
		}
		t.Skip("needs root to play another user")
	}
	cmd := daemontest.Command(otherBinary(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: otherUID, Gid: otherUID, Groups: groups}
	return cmd
}

// otherBinary is a copy of the test binary that the other user can run.
func otherBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := openDir(t)
	dst := filepath.Join(dir, "helper")
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	out.Close()
	return dst
}

// openDir is a temporary folder every user can enter (t.TempDir's are
// private to root).
func openDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ckptd-trust-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// runAct is the helper's side: it does what CKPTD_TEST_ACT says and
// prints one line: "ok ..." or the error's reason and message.
func runAct(act string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()
	report := func(what string, err error) {
		if err != nil {
			fmt.Printf("%s: %s %s\n", what, ckptd.Reason(err), err)
			return
		}
		fmt.Printf("%s: ok\n", what)
	}
	c, err := ckptd.Dial(os.Getenv("CKPTD_TEST_SOCKET"))
	if err != nil {
		report(act, err)
		return
	}
	defer c.Close()
	switch act {
	case "getarena":
		_, err = c.API().GetArena(ctx, &pb.GetArenaRequest{})
	case "save":
		_, err = c.Save(ctx, daemontest.Shard(1, 0, 1))
	case "release":
		_, err = c.API().ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: os.Getenv("CKPTD_TEST_LEASE")})
	case "readjournal":
		_, err = os.ReadDir(os.Getenv("CKPTD_TEST_JOURNAL"))
	case "dataset":
		var ds *ckptd.Dataset
		if ds, err = c.Dataset(ctx, &ckptd.DatasetRequest{Source: os.Getenv("CKPTD_TEST_SOURCE"), BatchSize: 1, WorldSize: 1}); err == nil {
			_ = ds.Close(ctx)
		}
	case "next-other", "position-other", "close-other", "release-in-own", "commit-other", "abort-other":
		err = othersObjectAct(ctx, act)
	case "flood":
		floodAct(ctx)
	default:
		err = holdAct(ctx, c, act)
	}
	report(act, err)
}

// othersObjectAct is the helper's side of TestOthersObjectsAreNotFound:
// it names, on a connection of its own, the session, delivery or save
// lease ($CKPTD_TEST_SESSION, _DELIVERY, _LEASE) another connection holds.
func othersObjectAct(ctx context.Context, act string) error {
	conn, err := rawConn(os.Getenv("CKPTD_TEST_SOCKET"))
	if err != nil {
		return err
	}
	defer conn.Close()
	pf, api := pb.NewPrefetchClient(conn), pb.NewCheckpointClient(conn)
	session, delivery, lease := os.Getenv("CKPTD_TEST_SESSION"), os.Getenv("CKPTD_TEST_DELIVERY"), os.Getenv("CKPTD_TEST_LEASE")
	switch act {
	case "next-other": // read its next batch, releasing its delivery
		_, err = pf.NextBatch(ctx, &pb.NextBatchRequest{Session: session, Release: []string{delivery}})
	case "position-other":
		_, err = pf.DatasetPosition(ctx, &pb.DatasetPositionRequest{Session: session, Position: 1})
	case "close-other":
		_, err = pf.CloseDataset(ctx, &pb.CloseDatasetRequest{Session: session})
	case "release-in-own": // its delivery, through a session of our own
		var own *pb.OpenDatasetResponse
		if own, err = pf.OpenDataset(ctx, &pb.OpenDatasetRequest{Source: os.Getenv("CKPTD_TEST_SOURCE"), BatchSize: 1, WorldSize: 1}); err == nil {
			_, err = pf.NextBatch(ctx, &pb.NextBatchRequest{Session: own.GetSession(), Release: []string{delivery}})
		}
	case "commit-other":
		_, err = api.CommitSave(ctx, &pb.CommitSaveRequest{LeaseId: lease})
	case "abort-other":
		_, err = api.AbortSave(ctx, &pb.AbortSaveRequest{LeaseId: lease})
	}
	return err
}

// rawConn is a plain gRPC connection to the daemon's socket: the calls the
// Go client does not expose.
func rawConn(socket string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// goodStep is a step a trust test saves before its attacks; check
// restores it after each, through a new connection, byte for byte.
type goodStep struct {
	d    *daemontest.Daemon
	want *ckptd.SaveRequest
}

func saveGood(t *testing.T, d *daemontest.Daemon, step int64) *goodStep {
	t.Helper()
	g := &goodStep{d: d, want: daemontest.Shard(step, 0, 1)}
	h, err := d.Client().Save(daemontest.Ctx(t), g.want)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	return g
}

// check asserts that the daemon survived attack and the good step
// restores as saved.
func (g *goodStep) check(t *testing.T, attack string) {
	t.Helper()
	select {
	case <-g.d.Exited():
		t.Fatalf("%s: the daemon died:\n%s", attack, g.d.Logs())
	default:
	}
	got, err := g.d.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: g.want.Step})
	if err != nil {
		t.Fatalf("%s: the good step no longer restores: %v", attack, err)
	}
	daemontest.CheckShard(t, got, g.want)
}

// startOpenDaemon starts a daemon whose socket folder others can enter.
func startOpenDaemon(t *testing.T, extra ...string) *daemontest.Daemon {
	t.Helper()
	return startDaemonIn(t, openDir(t), extra...)
}

// startDaemonIn starts a daemon whose socket is dir/ckptd.sock.
func startDaemonIn(t *testing.T, dir string, extra ...string) *daemontest.Daemon {
	t.Helper()
	d := daemontest.New(t, filepath.Join(dir, "ckptd.sock"), "", append([]string{"--staging-bytes", "64MiB", "--job", "e2e"}, extra...)...)
	d.Start()
	return d
}

// Only the daemon's user, root and its --socket-group reach it; a member
// can save, but cannot read the journal or touch another connection's
// regions. A step saved before restores intact after each attempt.
func TestPeerCredentials(t *testing.T) {
	allowed := openDir(t)
	daemontest.WriteShards(t, allowed, 1, 2)
	d := startOpenDaemon(t, "--socket-group", strconv.Itoa(shareGID), "--dataset-allow", allowed, "--slot-bytes", "1MiB")
	good := saveGood(t, d, 50)
	env := []string{"CKPTD_TEST_SOCKET=" + d.Socket, "CKPTD_DAEMON_UID=0"}

	// A non-member is stopped by the socket's mode (0660, of the group),
	// and the Go client says what would let it in (in words that may
	// change, naming --socket-group).
	if got := actAsOther(t, nil, append(env, "CKPTD_TEST_ACT=save")...); !strings.Contains(got, "--socket-group") {
		t.Fatalf("non-member at the socket's mode: %s", got)
	}
	good.check(t, "non-member at the socket's mode")

	// A non-member who gets through the file mode (a socket made 0666 by
	// mistake) is refused by the daemon, which names the uid, to the
	// client and in its log.
	if err := os.Chmod(d.Socket, 0o666); err != nil {
		t.Fatal(err)
	}
	if got := actAsOther(t, nil, append(env, "CKPTD_TEST_ACT=getarena")...); !strings.Contains(got, "PERMISSION_DENIED") || !strings.Contains(got, "uid 65534") {
		t.Fatalf("non-member: %s", got)
	}
	if line := logLine(d.Logs(), "refusing a client"); !strings.Contains(line, "uid="+strconv.Itoa(otherUID)+" ") {
		t.Errorf("the log line for the refused client does not name uid %d: %q\n%s", otherUID, line, d.Logs())
	}
	good.check(t, "non-member past the socket's mode")

	member := []uint32{shareGID}
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=save")...); got != "save: ok" {
		t.Fatalf("member's save: %s", got)
	}
	good.check(t, "member's save")
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=readjournal", "CKPTD_TEST_JOURNAL="+filepath.Join(d.Arena, "journal"))...); !strings.Contains(got, "permission denied") {
		t.Fatalf("member read the journal: %s", got)
	}
	good.check(t, "member reading the journal")

	// The daemon reads datasets for a member only where --dataset-allow
	// says: not its own store, not its journal.
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=dataset", "CKPTD_TEST_SOURCE="+allowed)...); got != "dataset: ok" {
		t.Fatalf("member's dataset in the allowed folder: %s", got)
	}
	for _, src := range []string{d.Storage, filepath.Join(d.Arena, "journal"), allowed + "/../" + filepath.Base(d.Storage)} {
		if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=dataset", "CKPTD_TEST_SOURCE="+src)...); !strings.Contains(got, "PERMISSION_DENIED") {
			t.Fatalf("member's dataset %s: %s", src, got)
		}
		good.check(t, "member's dataset "+src)
	}

	// A restore region of ours is not the member's to release.
	c := d.Client()
	if err := daemontest.WaitStep(t, c, 1, 0); err != nil {
		t.Fatal(err)
	}
	resp, err := c.API().BeginRestore(daemontest.Ctx(t), &pb.BeginRestoreRequest{Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	lease := resp.GetLease().GetId()
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=release", "CKPTD_TEST_LEASE="+lease)...); !strings.Contains(got, "UNKNOWN_LEASE") {
		t.Fatalf("member released our region: %s", got)
	}
	if _, err := c.API().ReleaseRegion(daemontest.Ctx(t), &pb.ReleaseRegionRequest{LeaseId: lease}); err != nil {
		t.Fatalf("our own release: %v", err)
	}
	good.check(t, "member releasing our region")
}

// logLine is the first line of logs that holds s, or "".
func logLine(logs, s string) string {
	for line := range strings.Lines(logs) {
		if strings.Contains(line, s) {
			return line
		}
	}
	return ""
}

// A member, on a connection of its own, finds nothing under the ids of
// another connection's dataset session, delivery or save lease: reading,
// positioning, closing, releasing, committing and aborting them are all
// NOT_FOUND, as for ids never issued, and the owner goes on using them.
func TestOthersObjectsAreNotFound(t *testing.T) {
	allowed := openDir(t)
	daemontest.WriteShards(t, allowed, 2, 4)
	d := startOpenDaemon(t, "--socket-group", strconv.Itoa(shareGID), "--dataset-allow", allowed, "--slot-bytes", "1MiB")
	good := saveGood(t, d, 50)
	conn, err := rawConn(d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	pf, api, ctx := pb.NewPrefetchClient(conn), pb.NewCheckpointClient(conn), daemontest.Ctx(t)
	open, err := pf.OpenDataset(ctx, &pb.OpenDatasetRequest{Source: allowed, BatchSize: 1, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := pf.NextBatch(ctx, &pb.NextBatchRequest{Session: open.GetSession()})
	if err != nil {
		t.Fatal(err)
	}
	save, err := api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target(9), Tensors: []*pb.Tensor{{Name: "w", Dtype: "U8", Shape: []int64{16}, Length: 16}}})
	if err != nil {
		t.Fatal(err)
	}
	env := []string{"CKPTD_TEST_SOCKET=" + d.Socket, "CKPTD_DAEMON_UID=0", "CKPTD_TEST_SOURCE=" + allowed,
		"CKPTD_TEST_SESSION=" + open.GetSession(), "CKPTD_TEST_DELIVERY=" + batch.GetLease().GetId(), "CKPTD_TEST_LEASE=" + save.GetLease().GetId()}
	for _, a := range []struct{ act, reason string }{
		{"next-other", "UNKNOWN_SESSION"},
		{"position-other", "UNKNOWN_SESSION"},
		{"close-other", "UNKNOWN_SESSION"},
		{"release-in-own", "UNKNOWN_SESSION"},
		{"commit-other", "UNKNOWN_LEASE"},
		{"abort-other", "UNKNOWN_LEASE"},
	} {
		got := actAsOther(t, []uint32{shareGID}, append(env, "CKPTD_TEST_ACT="+a.act)...)
		if !strings.HasPrefix(got, a.act+": "+a.reason+" ") || !strings.Contains(got, "code = NotFound") {
			t.Fatalf("member's %s: %s; want NOT_FOUND %s", a.act, got, a.reason)
		}
		good.check(t, "member's "+a.act)
	}

	// All still ours: the delivery to release, the session to read on and
	// close, the lease to abort.
	if _, err := pf.DatasetPosition(ctx, &pb.DatasetPositionRequest{Session: open.GetSession(), Position: batch.GetPosition()}); err != nil {
		t.Fatalf("our session's position: %v", err)
	}
	next, err := pf.NextBatch(ctx, &pb.NextBatchRequest{Session: open.GetSession(), Release: []string{batch.GetLease().GetId()}})
	if err != nil || len(next.GetSamples()) != 1 || next.GetPosition() != 2 {
		t.Fatalf("our session's next batch, releasing our delivery: %v, %v", next, err)
	}
	if _, err := pf.CloseDataset(ctx, &pb.CloseDatasetRequest{Session: open.GetSession()}); err != nil {
		t.Fatalf("closing our session: %v", err)
	}
	if _, err := api.AbortSave(ctx, &pb.AbortSaveRequest{LeaseId: save.GetLease().GetId()}); err != nil {
		t.Fatalf("aborting our save: %v", err)
	}
	good.check(t, "after the member's attempts")
}

// A daemon run by another user on the socket a trainer uses (squatting)
// while ours is down gets nothing: the client refuses it before the first
// request, and once ours is back the step saved before restores intact.
func TestSquattedSocketRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		actAsOther(t, nil) // skips, or fails under CI
	}
	dir := openDir(t)
	if err := os.Chmod(dir, os.ModeSticky|0o777); err != nil { // like /tmp
		t.Fatal(err)
	}
	d := startDaemonIn(t, dir)
	good := saveGood(t, d, 1)
	d.Stop()
	if _, err := os.Lstat(d.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("our daemon left its socket behind: %v", err)
	}
	store := filepath.Join(dir, "rogue-store")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(store, otherUID, otherUID); err != nil {
		t.Fatal(err)
	}
	socket, arena := d.Socket, daemontest.ArenaDir()
	rogue := daemontest.Command(otherBinaryCkptd(t), "serve", "--socket", socket, "--storage", store,
		"--arena-dir", arena, "--staging-bytes", "16MiB")
	rogue.SysProcAttr.Credential = &syscall.Credential{Uid: otherUID, Gid: otherUID}
	logf, err := os.Create(filepath.Join(t.TempDir(), "rogue.log"))
	if err != nil {
		t.Fatal(err)
	}
	rogue.Stdout, rogue.Stderr = logf, logf
	if err := rogue.Start(); err != nil {
		t.Fatal(err)
	}
	logs := func() string { b, _ := os.ReadFile(logf.Name()); return string(b) }
	t.Cleanup(func() {
		_ = rogue.Process.Kill()
		_ = rogue.Wait()
		logf.Close()
		os.RemoveAll(arena)
	})
	if !testtime.Within(time.Minute, func() bool { _, err := os.Stat(socket); return err == nil }) {
		t.Fatalf("rogue daemon did not start:\n%s", logs())
	}
	c, err := ckptd.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Save(ctx, daemontest.Shard(2, 0, 1))
	if !errors.Is(err, ckptd.ErrUntrustedDaemon) || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("save to a squatted socket: %v", err)
	}
	if entries, _ := os.ReadDir(store); len(entries) != 0 {
		t.Fatalf("the rogue daemon stored %d entries", len(entries))
	}

	// The rogue goes, the operator removes its socket, ours comes back.
	_ = rogue.Process.Kill()
	_ = rogue.Wait()
	if err := os.Remove(socket); err != nil {
		t.Fatal(err)
	}
	d.Start()
	good.check(t, "a squatted socket")
}

// otherBinaryCkptd is the ckptd binary, where another user can run it.
func otherBinaryCkptd(t *testing.T) string {
	t.Helper()
	dst := filepath.Join(openDir(t), "ckptd")
	data, err := os.ReadFile(daemontest.Bin(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// A step folder planted as a symlink out of the store: the daemon writes
// nothing outside, keeps the save staged, says why, and the step saved
// before restores intact.
func TestPlantedSymlinkInStore(t *testing.T) {
	d := daemontest.Start(t, "")
	good := saveGood(t, d, 1)
	outside := t.TempDir()
	steps := filepath.Join(d.Storage, "e2e", "steps")
	if err := os.MkdirAll(steps, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(steps, "000000000004")); err != nil {
		t.Fatal(err)
	}
	// Refused at once (the commit check meets the link), or, had the
	// link appeared later, kept staged with the reason in its status.
	_, err := d.Client().Save(daemontest.Ctx(t), daemontest.Shard(4, 0, 1))
	if err == nil || ckptd.Reason(err) != "STORE_UNSAFE" || !strings.Contains(err.Error(), "symbolic link") {
		t.Fatalf("save into a planted link: %v", err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Fatalf("the daemon wrote %d entries outside the store", len(entries))
	}
	good.check(t, "a planted symlink")
}
