package leftovers

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// ckptd delete and prune --keep-every on steps a daemon saved, as an
// operator runs them: a step goes, the others restore; the newest step
// and the whole job need --force, and a refusal changes nothing.
func TestDeleteAndKeepEvery(t *testing.T) {
	d := daemontest.Start(t, "")
	c := d.Client()
	daemontest.SaveAll(t, c, []int64{10, 20, 30, 40, 50}, 1, false)
	store := func(args ...string) (string, string, error) {
		return daemontest.CLI(t, append(args, "--storage", d.Storage, "--job", "e2e")...)
	}
	steps := func() string {
		out, stderr, err := store("list")
		if err != nil {
			t.Fatalf("list: %v\n%s", err, stderr)
		}
		var s []string
		for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
			s = append(s, strings.Fields(line)[0])
		}
		return strings.Join(s, ",")
	}

	out, stderr, err := store("delete", "--step", "50")
	if daemontest.ExitCode(err) != 2 || !strings.Contains(stderr, "newest committed step") || steps() != "10,20,30,40,50" {
		t.Fatalf("delete of the newest step without --force: exit %d\n%s%s", daemontest.ExitCode(err), out, stderr)
	}
	if _, stderr, err := daemontest.CLI(t, "delete", "--storage", d.Storage); daemontest.ExitCode(err) != 2 || !strings.Contains(stderr, "--step N") {
		t.Fatalf("delete naming nothing: exit %d\n%s", daemontest.ExitCode(err), stderr)
	}
	out, stderr, err = store("delete", "--step", "20")
	if err != nil || !strings.Contains(out, "deleted step 20") || steps() != "10,30,40,50" {
		t.Fatalf("delete --step 20: %v\n%s%s", err, out, stderr)
	}
	for _, s := range []int64{10, 30} {
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: s})
		if err != nil {
			t.Fatalf("load step %d after deleting step 20: %v", s, err)
		}
		daemontest.CheckShard(t, got, daemontest.Shard(s, 0, 1))
	}

	out, stderr, err = store("prune", "--keep-last", "0", "--keep-every", "20")
	if err != nil || steps() != "40" {
		t.Fatalf("prune --keep-last 0 --keep-every 20: %v, left %s\n%s%s", err, steps(), out, stderr)
	}
	if _, stderr, err := store("prune", "--keep-last", "0"); daemontest.ExitCode(err) != 2 || !strings.Contains(stderr, "--keep-every") {
		t.Fatalf("prune --keep-last 0 alone: exit %d\n%s", daemontest.ExitCode(err), stderr)
	}

	d.Stop()
	out, stderr, err = daemontest.CLI(t, "delete", "--storage", d.Storage, "--job", "e2e")
	if daemontest.ExitCode(err) != 2 || !strings.Contains(stderr, "--force") || steps() != "40" {
		t.Fatalf("delete --job without --force: exit %d\n%s%s", daemontest.ExitCode(err), out, stderr)
	}
	out, stderr, err = daemontest.CLI(t, "delete", "--storage", d.Storage, "--job", "e2e", "--force")
	if err != nil || !strings.Contains(out, `deleted job "e2e": steps [40]`) {
		t.Fatalf("delete --job --force: %v\n%s%s", err, out, stderr)
	}
	if entries, _ := os.ReadDir(filepath.Join(d.Storage, "e2e")); len(entries) != 0 {
		t.Errorf("after delete --job the job's folder holds %v", entries)
	}
}
