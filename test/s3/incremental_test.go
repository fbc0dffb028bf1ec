package s3

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/minio/minio-go/v7"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// frozen is rank's shard of step with step 100's weights: a fine-tune
// whose 6 MiB matrix never changes.
func frozen(step int64, rank, world int) *ckptd.SaveRequest {
	req := daemontest.Shard(step, rank, world)
	req.Tensors[0] = daemontest.Shard(100, rank, world).Tensors[0]
	return req
}

// `serve --incremental` on S3: steps after the first write only what
// changed, every step restores and verifies, prune keeps the first step's
// data (the newest references it) and leaves no pin or prune marker.
func TestS3Incremental(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--chunk-size", "1MiB", "--incremental")
	c := d.Client()
	const world = 2
	steps := []int64{100, 200, 300}
	for _, step := range steps {
		daemontest.SaveAndWait(t, c, frozen(step, 0, world), frozen(step, 1, world))
	}
	size := func(step int64) int64 {
		var n int64
		prefix := fmt.Sprintf("ckpt/e2e/steps/%012d/", step)
		for o := range srv.Client().ListObjects(t.Context(), bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
			if strings.HasSuffix(o.Key, ".data") {
				n += o.Size
			}
		}
		return n
	}
	full := size(100)
	for _, step := range steps[1:] {
		if n := size(step); n > full/20 {
			t.Fatalf("step %d stored %d bytes of data, the first step %d", step, n, full)
		}
	}
	for _, step := range steps {
		for rank := range world {
			got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: step, Rank: rank})
			if err != nil {
				t.Fatal(err)
			}
			daemontest.CheckShard(t, got, frozen(step, rank, world))
		}
	}
	cli := func(args ...string) string {
		stdout, stderr, err := daemontest.CLIEnv(t, srv.Env(), append(args, "--storage", store, "--job", "e2e")...)
		if err != nil {
			t.Fatalf("%v: %v\n%s%s", args, err, stdout, stderr)
		}
		return stdout
	}
	if out := cli("verify", "--step", "200"); !strings.Contains(out, "step 200 OK") {
		t.Fatalf("verify: %s", out)
	}
	cli("prune", "--keep-last", "1")
	kept := regexp.MustCompile(`^ckpt/e2e/steps/(000000000300/.*|000000000100/[^/]+/rank-0000[01]\.data)$`)
	for o := range srv.Client().ListObjects(t.Context(), bucket, minio.ListObjectsOptions{Recursive: true}) {
		if !kept.MatchString(o.Key) {
			t.Errorf("%s left after prune", o.Key)
		}
	}
	for rank := range world {
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 300, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, frozen(300, rank, world))
	}
	if out := cli("verify", "--latest"); !strings.Contains(out, "step 300 OK") {
		t.Fatalf("verify after prune: %s", out)
	}
}
