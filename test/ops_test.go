package test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// `ckptd health`, /healthz and /readyz: ready while storage answers, not
// ready while it does not, ready again once it is back.
func TestHealth(t *testing.T) {
	srv, _, store := s3Store(t)
	addr := closedAddr(t)
	d := startDaemonEnv(t, store, srv.Env(), "--metrics-addr", addr, "--s3-retry-deadline", "1s")
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
		out, stderr, err := ckptdCLI(t, "health", "--socket", d.socket)
		return out + stderr, err
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(200 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 30s\n%s", what, d.logs())
			}
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
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor("ready again", func() bool { code, _ := get("/readyz"); _, err := health(); return code == 200 && err == nil })
}

// --log-format json writes one JSON object per line, with one line per
// save carrying the stable keys.
func TestJSONLogs(t *testing.T) {
	d := startDaemon(t, "", "--log-format", "json")
	saveAndWait(t, d.client(), shard(1, 0, 1))
	d.stop()
	var saves int
	for line := range strings.Lines(d.logs()) {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("not a JSON line: %q: %v", line, err)
		}
		if rec["msg"] == "save durable" {
			saves++
			for _, k := range []string{"job", "step", "rank", "attempt", "bytes", "duration"} {
				if _, ok := rec[k]; !ok {
					t.Errorf("the save line lacks %q: %s", k, line)
				}
			}
		}
	}
	if saves != 1 {
		t.Fatalf("%d save lines for one save:\n%s", saves, d.logs())
	}
}

// A CLI command against a store that does not answer fails within its
// short default deadline, in one line, not one warning per retry.
func TestCLIDeadStoreFailsFast(t *testing.T) {
	srv, _, store := s3Store(t)
	env := withoutEndpoint(srv.Env())
	env = append(env, "AWS_ENDPOINT_URL=http://"+closedAddr(t))
	start := time.Now()
	_, stderr, err := ckptdCLIEnv(t, env, "list", "--storage", store, "--job", "e2e")
	took := time.Since(start)
	if err == nil || took > 45*time.Second {
		t.Fatalf("list against a dead store: %v after %s", err, took)
	}
	if lines := strings.Count(strings.TrimSpace(stderr), "\n") + 1; lines != 1 {
		t.Fatalf("%d lines of stderr, want one:\n%s", lines, stderr)
	}
}
