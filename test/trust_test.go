package test

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

	"github.com/ckptd/ckptd/clients/go/ckptd"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
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
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("the trust tests need root (to play another user) and CI runs as root")
		}
		t.Skip("needs root to play another user")
	}
	cmd := exec.Command(otherBinary(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: otherUID, Gid: otherUID, Groups: groups}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as uid %d: %v\n%s", otherUID, err, out)
	}
	return strings.TrimSpace(string(out))
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
		_, err = c.Save(ctx, shard(1, 0, 1))
	case "release":
		_, err = c.API().ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: os.Getenv("CKPTD_TEST_LEASE")})
	case "readjournal":
		_, err = os.ReadDir(os.Getenv("CKPTD_TEST_JOURNAL"))
	case "dataset":
		var ds *ckptd.Dataset
		if ds, err = c.Dataset(ctx, &ckptd.DatasetRequest{Source: os.Getenv("CKPTD_TEST_SOURCE"), BatchSize: 1, WorldSize: 1}); err == nil {
			_ = ds.Close(ctx)
		}
	default:
		err = holdAct(ctx, c, act)
	}
	report(act, err)
}

// startOpenDaemon starts a daemon whose socket folder others can enter.
func startOpenDaemon(t *testing.T, extra ...string) *daemon {
	t.Helper()
	dir := openDir(t)
	d := &daemon{t: t, socket: filepath.Join(dir, "ckptd.sock"), storage: filepath.Join(t.TempDir(), "store"),
		arena: filepath.Join("/dev/shm", fmt.Sprintf("ckptd-test-%d-%d", os.Getpid(), arenaSeq.Add(1)))}
	d.args = append([]string{"serve", "--socket", d.socket, "--storage", d.storage, "--arena-dir", d.arena,
		"--staging-bytes", "64MiB", "--job", "e2e"}, extra...)
	t.Cleanup(func() { d.stop(); os.RemoveAll(d.arena) })
	d.start()
	return d
}

// Only the daemon's user, root and its --socket-group reach it; a member
// can save, but cannot read the journal or touch another connection's
// regions.
func TestPeerCredentials(t *testing.T) {
	allowed := openDir(t)
	writeShards(t, allowed, 1, 2)
	d := startOpenDaemon(t, "--socket-group", strconv.Itoa(shareGID), "--dataset-allow", allowed, "--slot-bytes", "1MiB")
	env := []string{"CKPTD_TEST_SOCKET=" + d.socket, "CKPTD_DAEMON_UID=0"}

	// A non-member who gets through the file mode (a socket made 0666 by
	// mistake) is refused by the daemon, which names the uid.
	if err := os.Chmod(d.socket, 0o666); err != nil {
		t.Fatal(err)
	}
	if got := actAsOther(t, nil, append(env, "CKPTD_TEST_ACT=getarena")...); !strings.Contains(got, "PERMISSION_DENIED") || !strings.Contains(got, "uid 65534") {
		t.Fatalf("non-member: %s", got)
	}
	if !strings.Contains(d.logs(), "refusing a client") {
		t.Errorf("no log line for the refused client:\n%s", d.logs())
	}

	member := []uint32{shareGID}
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=save")...); got != "save: ok" {
		t.Fatalf("member's save: %s", got)
	}
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=readjournal", "CKPTD_TEST_JOURNAL="+filepath.Join(d.arena, "journal"))...); !strings.Contains(got, "permission denied") {
		t.Fatalf("member read the journal: %s", got)
	}

	// The daemon reads datasets for a member only where --dataset-allow
	// says: not its own store, not its journal.
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=dataset", "CKPTD_TEST_SOURCE="+allowed)...); got != "dataset: ok" {
		t.Fatalf("member's dataset in the allowed folder: %s", got)
	}
	for _, src := range []string{d.storage, filepath.Join(d.arena, "journal"), allowed + "/../" + filepath.Base(d.storage)} {
		if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=dataset", "CKPTD_TEST_SOURCE="+src)...); !strings.Contains(got, "PERMISSION_DENIED") {
			t.Fatalf("member's dataset %s: %s", src, got)
		}
	}

	// A restore region of ours is not the member's to release.
	c := d.client()
	if err := waitStep(t, c, 1, 0); err != nil {
		t.Fatal(err)
	}
	resp, err := c.API().BeginRestore(ctxT(t), &pb.BeginRestoreRequest{Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	lease := resp.GetLease().GetId()
	if got := actAsOther(t, member, append(env, "CKPTD_TEST_ACT=release", "CKPTD_TEST_LEASE="+lease)...); !strings.Contains(got, "UNKNOWN_LEASE") {
		t.Fatalf("member released our region: %s", got)
	}
	if _, err := c.API().ReleaseRegion(ctxT(t), &pb.ReleaseRegionRequest{LeaseId: lease}); err != nil {
		t.Fatalf("our own release: %v", err)
	}
}

// A daemon run by another user on the socket a trainer uses (squatting)
// gets nothing: the client refuses it before the first request.
func TestSquattedSocketRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		actAsOther(t, nil) // skips, or fails under CI
	}
	dir := openDir(t)
	if err := os.Chmod(dir, 0o1777); err != nil { // like /tmp
		t.Fatal(err)
	}
	store := filepath.Join(dir, "rogue-store")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(store, otherUID, otherUID); err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(dir, "ckptd.sock")
	rogue := exec.Command(otherBinaryCkptd(t), "serve", "--socket", socket, "--storage", store,
		"--arena-dir", fmt.Sprintf("/dev/shm/ckptd-rogue-%d", os.Getpid()), "--staging-bytes", "16MiB")
	rogue.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: otherUID, Gid: otherUID}}
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
		os.RemoveAll(fmt.Sprintf("/dev/shm/ckptd-rogue-%d", os.Getpid()))
	})
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(socket); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rogue daemon did not start:\n%s", logs())
		}
	}
	c, err := ckptd.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Save(ctx, shard(1, 0, 1))
	if !errors.Is(err, ckptd.ErrUntrustedDaemon) || !strings.Contains(err.Error(), "uid 65534") {
		t.Fatalf("save to a squatted socket: %v", err)
	}
	if entries, _ := os.ReadDir(store); len(entries) != 0 {
		t.Fatalf("the rogue daemon stored %d entries", len(entries))
	}
}

// otherBinaryCkptd is the ckptd binary, where another user can run it.
func otherBinaryCkptd(t *testing.T) string {
	t.Helper()
	dst := filepath.Join(openDir(t), "ckptd")
	data, err := os.ReadFile(ckptdBin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// A step folder planted as a symlink out of the store: the daemon writes
// nothing outside, keeps the save staged, and says why.
func TestPlantedSymlinkInStore(t *testing.T) {
	d := startDaemon(t, "")
	outside := t.TempDir()
	steps := filepath.Join(d.storage, "e2e", "steps")
	if err := os.MkdirAll(steps, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(steps, "000000000004")); err != nil {
		t.Fatal(err)
	}
	// Refused at once (the commit check meets the link), or, had the
	// link appeared later, kept staged with the reason in its status.
	_, err := d.client().Save(ctxT(t), shard(4, 0, 1))
	if err == nil || ckptd.Reason(err) != "STORE_UNSAFE" || !strings.Contains(err.Error(), "symbolic link") {
		t.Fatalf("save into a planted link: %v", err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Fatalf("the daemon wrote %d entries outside the store", len(entries))
	}
}
