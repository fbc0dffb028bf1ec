package s3

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/test/daemontest"
)

// Save through `ckptd serve --storage s3://...`, then restore, list,
// verify and prune with the CLI, as with a directory.
// The same with --spread-data: the data objects go under
// steps/spread-<hh>/, and restore, verify and prune find them there.
func TestS3SaveRestore(t *testing.T) {
	for _, spread := range []bool{false, true} {
		t.Run(fmt.Sprintf("spread=%v", spread), func(t *testing.T) { s3SaveRestore(t, spread) })
	}
}

func s3SaveRestore(t *testing.T, spread bool) {
	srv, bucket, store := daemontest.S3Store(t)
	args := []string{"--chunk-size", "1MiB"}
	if spread {
		args = append(args, "--spread-data")
	}
	d := daemontest.StartEnv(t, store, srv.Env(), args...)
	c := d.Client()
	const world = 2
	daemontest.SaveAll(t, c, []int64{100, 200}, world, false)
	daemontest.SaveAll(t, c, []int64{300}, world, true)

	steps, err := c.Steps(daemontest.Ctx(t), "")
	if err != nil || len(steps) != 3 || steps[2].Step != 300 {
		t.Fatalf("Steps = %+v, %v", steps, err)
	}
	for rank := range world {
		got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 100, Rank: rank})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, daemontest.Shard(100, rank, world))
	}
	// The layout is the contract's, under the URL's prefix.
	if _, err := srv.Client().StatObject(t.Context(), bucket, "ckpt/e2e/steps/000000000200/COMMIT.json", minio.StatObjectOptions{}); err != nil {
		t.Fatalf("commit record not where the layout says: %v", err)
	}

	// The endpoint from the flag rather than the environment.
	env := daemontest.WithoutEndpoint(srv.Env())
	out := t.TempDir()
	if _, stderr, err := daemontest.CLIEnv(t, env, "restore", "--storage", store, "--s3-endpoint", srv.Endpoint(), "--job", "e2e", "--step", "200", "--out", out); err != nil {
		t.Fatalf("restore: %v\n%s", err, stderr)
	}
	for rank := range world {
		daemontest.CheckSafetensors(t, filepath.Join(out, fmt.Sprintf("rank-%05d.safetensors", rank)), daemontest.Shard(200, rank, world))
	}
	stdout, stderr, err := daemontest.CLIEnv(t, srv.Env(), "list", "--storage", store, "--job", "e2e", "--json")
	var listed []struct{ Step int64 }
	if err != nil || json.Unmarshal([]byte(stdout), &listed) != nil || len(listed) != 3 {
		t.Fatalf("list --json: %v\n%s%s", err, stdout, stderr)
	}
	if stdout, stderr, err = daemontest.CLIEnv(t, srv.Env(), "verify", "--storage", store, "--job", "e2e", "--latest"); err != nil || !strings.Contains(stdout, "step 300 OK") {
		t.Fatalf("verify: %v %s%s", err, stdout, stderr)
	}
	if stdout, stderr, err = daemontest.CLIEnv(t, srv.Env(), "prune", "--storage", store, "--job", "e2e", "--keep-last", "1"); err != nil {
		t.Fatalf("prune: %v %s%s", err, stdout, stderr)
	}
	if steps, _ := c.Steps(daemontest.Ctx(t), ""); len(steps) != 1 || steps[0].Step != 300 {
		t.Fatalf("after prune: %+v", steps)
	}
	var keys []string
	for o := range srv.Client().ListObjects(t.Context(), bucket, minio.ListObjectsOptions{Recursive: true}) {
		keys = append(keys, o.Key)
	}
	spreadData := regexp.MustCompile(`^ckpt/e2e/steps/spread-[0-9a-f]{2}/000000000300/[^/]+/rank-0000[01]\.data$`)
	var data int
	for _, k := range keys {
		switch {
		case spreadData.MatchString(k):
			data++
		case strings.HasPrefix(k, "ckpt/e2e/steps/000000000300/"):
			if strings.HasSuffix(k, ".data") {
				data++
				if spread {
					t.Errorf("%s: data in the step's folder with --spread-data", k)
				}
			}
		default:
			t.Errorf("%s left after prune", k)
		}
	}
	if data != world {
		t.Errorf("%d data objects of the kept step, want %d: %v", data, world, keys)
	}
	srv.CheckNoUploads(t, bucket)
}

// Two sidecars sharing one bucket, each saving half the ranks of a step,
// commit it exactly once: the commit record is a conditional PUT.
func TestS3TwoDaemonsCommitOnce(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	daemontest.CommitOnceAcross(t, daemontest.StartEnv(t, store, srv.Env()), daemontest.StartEnv(t, store, srv.Env()))
	srv.CheckNoUploads(t, bucket)
}

// bigShard is one rank's shard with a single tensor of mib MiB of
// weights, large enough to go up as a multipart upload of several parts.
func bigShard(step int64, mib int) *ckptd.SaveRequest {
	r := rand.New(rand.NewPCG(uint64(step), 99))
	n := mib << 20 / 4
	b := make([]byte, 4*n)
	for i := range n {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
	}
	return &ckptd.SaveRequest{
		Step: step, Rank: 0, WorldSize: 1, Metadata: []byte("big"),
		Tensors: []ckptd.Tensor{{Name: "w", DType: "F32", Shape: []int64{int64(n)}, Data: b}},
	}
}

// MinIO is killed and restarted, then frozen, in the middle of drains;
// each step still commits with the right bytes and no multipart upload is
// left behind.
func TestS3DrainSurvivesOutage(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env())
	c := d.Client()
	outages := []struct {
		name string
		hit  func()
	}{
		{"kill and restart", func() {
			srv.Kill()
			time.Sleep(time.Second)
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
		{"freeze", func() {
			srv.Freeze()
			time.Sleep(3 * time.Second)
			srv.Thaw()
		}},
	}
	for i, o := range outages {
		step := int64(i + 1)
		req := bigShard(step, 96)
		ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(3*time.Minute))
		defer cancel()
		h, err := c.Save(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if !waitForUpload(t, srv, bucket) {
			t.Fatalf("%s: the drain finished before a multipart upload was seen; make the shard larger", o.name)
		}
		o.hit()
		if err := h.Wait(ctx); err != nil {
			t.Fatalf("%s: step %d did not commit: %v\n%s", o.name, step, err, d.Logs())
		}
		got, err := c.Load(ctx, &ckptd.LoadRequest{Step: step})
		if err != nil {
			t.Fatal(err)
		}
		daemontest.CheckShard(t, got, req)
		if stdout, stderr, err := daemontest.CLIEnv(t, srv.Env(), "verify", "--storage", store, "--job", "e2e", "--step", fmt.Sprint(step)); err != nil {
			t.Fatalf("verify after %s: %v %s%s", o.name, err, stdout, stderr)
		}
		srv.CheckNoUploads(t, bucket)
	}
}

// waitForUpload polls until a multipart upload is in progress in bucket.
func waitForUpload(t *testing.T, srv *miniotest.Server, bucket string) bool {
	deadline := time.Now().Add(testtime.Scale(time.Minute))
	for time.Now().Before(deadline) {
		ups, err := srv.IncompleteUploads(t.Context(), bucket, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(ups) > 0 {
			return true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return false
}

// Wrong credentials and a missing bucket fail at once with messages that
// name the bucket and the endpoint, and never print the secret.
func TestS3Errors(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	const wrongSecret = "wrong-secret-0123456789"
	wrongCreds := append(srv.Env(), "AWS_SECRET_ACCESS_KEY="+wrongSecret)
	dead := "http://" + daemontest.ClosedAddr(t)
	tests := []struct {
		name string
		env  []string
		args []string
		want []string
	}{
		{"wrong credentials", wrongCreds, []string{"list", "--storage", store}, []string{"access denied", bucket, srv.Endpoint()}},
		{"missing bucket", srv.Env(), []string{"list", "--storage", "s3://missing-bucket/x"}, []string{"missing-bucket", "does not exist", srv.Endpoint()}},
		{"restore, missing bucket", srv.Env(), []string{"restore", "--storage", "s3://missing-bucket", "--latest", "--out", t.TempDir()}, []string{"missing-bucket", "does not exist"}},
		{"bad endpoint", srv.Env(), []string{"list", "--storage", store, "--s3-endpoint", "127.0.0.1:9000"}, []string{"http:// or https://"}},
		{"dead endpoint", srv.Env(), []string{"list", "--storage", store, "--s3-endpoint", dead, "--s3-retry-deadline", "1s"}, []string{dead, "connection refused"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			_, stderr, err := daemontest.CLIEnv(t, tt.env, tt.args...)
			if err == nil {
				t.Fatalf("%v succeeded", tt.args)
			}
			for _, w := range tt.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr %q does not contain %q", stderr, w)
				}
			}
			if strings.Contains(stderr, wrongSecret) || strings.Contains(stderr, srv.SecretKey) {
				t.Errorf("stderr reveals a secret: %s", stderr)
			}
			if el := time.Since(start); el > testtime.Scale(20*time.Second) {
				t.Errorf("took %v to fail", el)
			}
		})
	}

	// serve refuses to start on a store it cannot use.
	ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(time.Minute))
	defer cancel()
	dir := t.TempDir()
	cmd := exec.CommandContext(ctx, daemontest.Bin(t), "serve", "--socket", filepath.Join(dir, "s.sock"),
		"--arena-dir", daemontest.ArenaDir(), "--staging-bytes", "64MiB",
		"--storage", "s3://missing-bucket")
	cmd.Env = append(cmd.Environ(), srv.Env()...)
	out, err := cmd.CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "does not exist") {
		t.Fatalf("serve on a missing bucket: %v\n%s", err, out)
	}

	// A dead endpoint fails the start within --storage-wait, saying so
	// (not after the two minutes of --s3-retry-deadline).
	start := time.Now()
	cmd = exec.CommandContext(ctx, daemontest.Bin(t), "serve", "--socket", filepath.Join(dir, "d.sock"),
		"--arena-dir", daemontest.ArenaDir(), "--staging-bytes", "64MiB", "--storage", store,
		"--s3-endpoint", dead, "--storage-wait", "2s")
	cmd.Env = append(cmd.Environ(), srv.Env()...)
	out, err = cmd.CombinedOutput()
	if err == nil || ctx.Err() != nil || !strings.Contains(string(out), "did not answer within --storage-wait 2s") ||
		time.Since(start) > testtime.Scale(30*time.Second) {
		t.Fatalf("serve on a dead endpoint: %v after %v\n%s", err, time.Since(start), out)
	}
}

// A save made while the store is down is accepted at once (the trainer
// must not stall on storage) and commits once the store is back.
func TestS3SaveWhileStoreDown(t *testing.T) {
	srv, bucket, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env())
	c := d.Client()
	srv.Kill()
	req := daemontest.Shard(5, 0, 1)
	start := time.Now()
	h, err := c.Save(daemontest.Ctx(t), req)
	if err != nil {
		t.Fatalf("save with the store down: %v", err)
	}
	// The precheck gives up after 1s; the retry deadline is 2 minutes.
	if el := time.Since(start); el > testtime.Scale(20*time.Second) {
		t.Errorf("save with the store down took %v", el)
	}
	time.Sleep(time.Second) // let the drain fail and retry at least once
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatalf("step did not commit after the store came back: %v\n%s", err, d.Logs())
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 5})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, req)
	srv.CheckNoUploads(t, bucket)
}

// A restore while the store is down is UNAVAILABLE with reason
// STORAGE_UNAVAILABLE (the Go client's ErrStorageUnavailable), not
// DATA_LOSS or NOT_FOUND, within the daemon's retry deadline; once the
// store is back the same load restores byte-exact. MinIO is killed before
// the load, and frozen in the middle of one (the chunk reads fail then).
func TestS3RestoreDuringOutage(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--s3-retry-deadline", "3s", "--s3-stall-timeout", "2s")
	c := d.Client()
	req := bigShard(1, 64)
	daemontest.SaveAndWait(t, c, req)
	srv.Kill()
	start := time.Now()
	_, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if !errors.Is(err, ckptd.ErrStorageUnavailable) || status.Code(daemontest.UnwrapStatus(err)) != codes.Unavailable {
		t.Fatalf("load with the store down: %v (reason %q), want UNAVAILABLE / STORAGE_UNAVAILABLE", err, ckptd.Reason(err))
	}
	t.Logf("refused after %v: %v", time.Since(start), err)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	got, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
	if err != nil {
		t.Fatal(err)
	}
	daemontest.CheckShard(t, got, req)

	// Frozen once the restore has begun reading chunks.
	done := make(chan error, 1)
	go func() {
		_, err := c.Load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 1})
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	srv.Freeze()
	err = <-done
	srv.Thaw()
	if err != nil && (!errors.Is(err, ckptd.ErrStorageUnavailable) || errors.Is(err, ckptd.ErrCorrupt)) {
		t.Fatalf("load with the store frozen midway: %v (reason %q), want UNAVAILABLE / STORAGE_UNAVAILABLE", err, ckptd.Reason(err))
	}
	t.Logf("load with the store frozen midway: %v", err)
}
