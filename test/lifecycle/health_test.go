package lifecycle

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// A step whose weights hold NaN or Inf (a run that diverged) is counted
// as it drains: list shows it, and restore and export --latest --finite
// pass over it, naming it, to the newest step that is whole and finite.
func TestNonFiniteSteps(t *testing.T) {
	metrics := daemontest.ClosedAddr(t)
	d := daemontest.Start(t, "", "--metrics-addr", metrics)
	c := d.Client()
	daemontest.SaveAndWait(t, c, daemontest.Shard(1, 0, 1))
	diverged := daemontest.Shard(2, 0, 1)
	w := diverged.Tensors[0].Data
	binary.LittleEndian.PutUint32(w[40:], math.Float32bits(float32(math.NaN())))
	binary.LittleEndian.PutUint32(w[4<<20:], math.Float32bits(float32(math.Inf(-1)))) // another chunk
	daemontest.SaveAndWait(t, c, diverged)
	store := []string{"--storage", d.Storage, "--job", "e2e"}

	out, stderr, err := daemontest.CLI(t, append([]string{"list", "--json"}, store...)...)
	var steps []struct {
		Step             int64 `json:"step"`
		NonFinite        int64 `json:"nonfinite"`
		NonFiniteTensors int   `json:"nonfinite_tensors"`
	}
	if err != nil || json.Unmarshal([]byte(out), &steps) != nil || len(steps) != 2 {
		t.Fatalf("list --json: %v\n%s%s", err, out, stderr)
	}
	if steps[0].NonFinite != 0 || steps[1].NonFinite != 2 || steps[1].NonFiniteTensors != 1 {
		t.Fatalf("list --json counts %+v; want step 2's 2 values in 1 tensor", steps)
	}
	if out, _, _ := daemontest.CLI(t, append([]string{"list"}, store...)...); !strings.Contains(out, "2 in 1 tensors") {
		t.Errorf("list does not show step 2's NaN and Inf:\n%s", out)
	}

	dir := t.TempDir()
	out, stderr, err = daemontest.CLI(t, append([]string{"restore", "--latest", "--finite", "--out", dir}, store...)...)
	if err != nil || !strings.Contains(stderr, "passed over steps [2]") {
		t.Fatalf("restore --latest --finite: %v\n%s%s", err, out, stderr)
	}
	meta, err := os.ReadFile(filepath.Join(dir, "metadata.json"))
	if err != nil || !strings.Contains(string(meta), `"step": 1`) {
		t.Fatalf("restore --latest --finite wrote %s (%v), want step 1", meta, err)
	}
	daemontest.CheckSafetensors(t, filepath.Join(dir, "rank-00000.safetensors"), daemontest.Shard(1, 0, 1))
	if _, stderr, err := daemontest.CLI(t, append([]string{"restore", "--step", "2", "--finite", "--out", dir}, store...)...); daemontest.ExitCode(err) != 2 {
		t.Errorf("restore --step --finite: exit %d, want 2\n%s", daemontest.ExitCode(err), stderr)
	}
	// Without --finite the newest step is the newest step.
	if _, _, err := daemontest.CLI(t, append([]string{"restore", "--latest", "--out", t.TempDir()}, store...)...); err != nil {
		t.Errorf("restore --latest of a step holding NaN: %v", err)
	}

	// A trainer's load of latest, finite, through the daemon.
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true, Finite: true})
	if err != nil || got.Step != 1 || fmt.Sprint(got.SkippedNonFinite) != "[2]" {
		t.Fatalf("load latest finite: %v; step %d, passed over %v; want step 1, passing over [2]", err, got.Step, got.SkippedNonFinite)
	}
	daemontest.CheckShard(t, got, daemontest.Shard(1, 0, 1))
	resp, err := http.Get("http://" + metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(body), `ckptd_nonfinite_tensors_total{job="e2e"} 1`) {
		t.Errorf("/metrics does not count the tensor holding NaN and Inf:\n%s", body)
	}
}
