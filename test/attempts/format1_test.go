package attempts

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// format1Shard is what testdata/format1 holds: step 5 of job e2e, two
// ranks, saved by the daemon and Go client of ckptd before attempts
// existed (commit 7382452: manifest and commit record format 1, objects
// at steps/<step>/rank-NNNNN.*) with this function.
func format1Shard(rank int) *ckptd.SaveRequest {
	r := rand.New(rand.NewPCG(5, uint64(rank)))
	w := make([]byte, 4*64*64)
	for i := range 64 * 64 {
		binary.LittleEndian.PutUint32(w[4*i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
	}
	return &ckptd.SaveRequest{Step: 5, Rank: rank, WorldSize: 2,
		Metadata: []byte(fmt.Sprintf(`{"format": 1, "rank": %d}`, rank)),
		Tensors: []ckptd.Tensor{
			{Name: "model.w", DType: "F32", Shape: []int64{64, 64}, Data: w},
			{Name: "step", DType: "I64", Shape: []int64{}, Data: binary.LittleEndian.AppendUint64(nil, 5)},
		}}
}

// A store written by the previous format restores through the daemon and
// the CLI, lists, verifies and prunes, on POSIX and on MinIO, next to a
// step saved now.
func TestFormat1Store(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := mk(t)
			err := filepath.WalkDir("testdata/format1", func(path string, e fs.DirEntry, err error) error {
				if err != nil || e.IsDir() {
					return err
				}
				data, err := os.ReadFile(path)
				if err != nil {
					return err
				}
				s.put(t, strings.TrimPrefix(path, "testdata/format1/"), data)
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			d := s.daemon(t)
			c := d.Client()
			for rank := range 2 {
				got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 5, Rank: rank})
				if err != nil {
					t.Fatal(err)
				}
				if got.Attempt != "" {
					t.Errorf("a format-1 step restored with attempt %q", got.Attempt)
				}
				daemontest.CheckShard(t, got, format1Shard(rank))
			}
			out := t.TempDir()
			if o, e, err := daemontest.CLIEnv(t, s.env, "restore", "--storage", s.url, "--job", "e2e", "--step", "5", "--out", out); err != nil {
				t.Fatalf("restore: %v %s%s", err, o, e)
			}
			if files, _ := filepath.Glob(filepath.Join(out, "*.safetensors")); len(files) != 2 {
				t.Fatalf("restore wrote %v", files)
			}
			daemontest.SaveAndWait(t, c, attemptShard("now", 6, 0, 1))
			o, _, err := daemontest.CLIEnv(t, s.env, "list", "--json", "--storage", s.url, "--job", "e2e")
			var steps []struct {
				Step    int64
				Attempt string
			}
			if err != nil || json.Unmarshal([]byte(o), &steps) != nil || len(steps) != 2 || steps[0].Step != 5 || steps[0].Attempt != "" || steps[1].Attempt != "now" {
				t.Fatalf("list: %v %s", err, o)
			}
			for _, step := range []string{"5", "6"} {
				if o, e, err := daemontest.CLIEnv(t, s.env, "verify", "--storage", s.url, "--job", "e2e", "--step", step); err != nil {
					t.Fatalf("verify step %s: %v %s%s", step, err, o, e)
				}
			}
			if o, _, err := daemontest.CLIEnv(t, s.env, "prune", "--storage", s.url, "--job", "e2e", "--keep-last", "2"); err != nil || strings.Contains(o, "removed 5") {
				t.Fatalf("prune of a healthy mixed store: %v %s", err, o)
			}
			if o, e, err := daemontest.CLIEnv(t, s.env, "prune", "--storage", s.url, "--job", "e2e", "--keep-last", "1"); err != nil {
				t.Fatalf("prune --keep-last 1: %v %s%s", err, o, e)
			}
			o, _, err = daemontest.CLIEnv(t, s.env, "list", "--all", "--json", "--storage", s.url, "--job", "e2e")
			if err != nil || strings.Contains(o, `"step": 5`) {
				t.Fatalf("the format-1 step outlived prune --keep-last 1: %v %s", err, o)
			}
		})
	}
}
