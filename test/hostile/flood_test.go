package hostile

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/server"
	"github.com/ckptd/ckptd/test/daemontest"
)

// A member of the socket's group opens connection after connection, each
// holding a call open, as a leaking or hostile client would: past its
// share of the socket's bounds it is told RESOURCE_EXHAUSTED naming the
// bound, the daemon's heap stays within what --print-memory counts for
// the socket, and the daemon's own user still saves and restores.
func TestSocketFlood(t *testing.T) {
	metrics := daemontest.ClosedAddr(t)
	d := startOpenDaemon(t, "--socket-group", strconv.Itoa(shareGID), "--metrics-addr", metrics)
	good := saveGood(t, d, 50)
	_, before := rssAnon(t, d.Cmd.Process.Pid)

	line := holdAsOther(t, []uint32{shareGID}, "CKPTD_TEST_SOCKET="+d.Socket, "CKPTD_TEST_ACT=flood")
	share := server.DefaultIntake.Conns * 3 / 4
	if want := fmt.Sprintf("held %d connections; then: OVER_BUDGET ", share); !strings.HasPrefix(line, want) || !strings.Contains(line, "takes 512 connections at once and one uid may hold 384 (uid 65534 holds") {
		t.Fatalf("the flood: %q, want %q... naming the bound", line, want)
	}
	good.check(t, "a member's connection flood")
	h, err := d.Client().Save(daemontest.Ctx(t), daemontest.Shard(51, 0, 1))
	if err == nil {
		err = h.Wait(daemontest.Ctx(t))
	}
	if err != nil {
		t.Fatalf("the owner's save during the flood: %v", err)
	}
	// The operator sees it too: the refusal counted, the connections held.
	resp, err := http.Get("http://" + metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	held := 0
	if m := regexp.MustCompile(`(?m)^ckptd_socket_connections (\d+)$`).FindSubmatch(body); m != nil {
		held, _ = strconv.Atoi(string(m[1]))
	}
	if !strings.Contains(string(body), `ckptd_socket_refused_total{bound="connections"} 1`) || held < share+1 {
		t.Errorf("the metrics do not show the flood:\n%s", grepLines(string(body), "ckptd_socket_"))
	}
	_, peak := rssAnon(t, d.Cmd.Process.Pid)
	t.Logf("%s; the daemon's heap grew %d MiB (peak)", line, (peak-before)>>20)
	if peak-before > server.DefaultIntake.Bytes() {
		t.Errorf("the flood took %d MiB of the daemon's memory; the socket's bound is %d MiB", (peak-before)>>20, server.DefaultIntake.Bytes()>>20)
	}
}

// holdAsOther runs an action (see holdAct) as uid 65534 with groups, and
// returns its first line once it prints one that starts with "held"; the
// process holds what it took until the test ends.
func holdAsOther(t *testing.T, groups []uint32, env ...string) string {
	t.Helper()
	cmd := otherCommand(t, groups, append(env, "CKPTD_DAEMON_UID=0")...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, _ := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "held") {
		t.Fatalf("helper as uid %d: %q", otherUID, line)
	}
	return strings.TrimSpace(line)
}

// floodAct is the helper's side of TestSocketFlood: connections, each
// watching the daemon's health (a call that stays open), until one is
// refused; it prints what it held and the refusal, and holds on.
func floodAct(ctx context.Context) {
	var held []*grpc.ClientConn
	var refusal error
	for len(held) < 2*server.DefaultIntake.Conns {
		conn, err := rawConn(os.Getenv("CKPTD_TEST_SOCKET"))
		if err != nil {
			refusal = err
			break
		}
		w, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{})
		if err == nil {
			_, err = w.Recv()
		}
		if err != nil {
			refusal = err
			break
		}
		held = append(held, conn)
	}
	fmt.Printf("held %d connections; then: %s %v\n", len(held), ckptd.Reason(refusal), refusal)
	time.Sleep(time.Hour)
}

// grepLines is the lines of s that hold sub.
func grepLines(s, sub string) string {
	var out strings.Builder
	for line := range strings.Lines(s) {
		if strings.Contains(line, sub) {
			out.WriteString(line)
		}
	}
	return out.String()
}
