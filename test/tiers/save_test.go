package tiers

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/test/daemontest"
)

// storageLook is how long the daemon gives storage to say whether a
// save's step is committed (staging's precheckTimeout): what a save
// would wait each time if it waited for a store that does not answer.
const storageLook = time.Second

// A save never waits for storage: with the store frozen (it takes
// connections and never answers), saves take about what they take with
// the store up (measured in the same run), not a second each more. A
// committed step is still refused: before anything is copied when this
// daemon saw it committed, at the commit when only storage knows.
func TestSaveDoesNotWaitForStorage(t *testing.T) {
	srv, _, store := daemontest.S3Store(t)
	d := daemontest.StartEnv(t, store, srv.Env(), "--shutdown-grace", "1s")
	c := d.Client()
	const n = 10
	saves := func(from int64) time.Duration {
		t.Helper()
		start := time.Now()
		for step := from; step < from+n; step++ {
			daemontest.Save(t, c, daemontest.Shard(step, 0, 1))
		}
		return time.Since(start)
	}
	up := saves(1)
	if err := daemontest.WaitStep(t, c, 1, 0); err != nil {
		t.Fatal(err)
	}

	// Seen committed here: refused at BeginSave, before a copy.
	begin := &pb.BeginSaveRequest{Target: daemontest.Target(1), Tensors: []*pb.Tensor{daemontest.F32Tensor("w", 0, 16)}}
	if _, err := c.API().BeginSave(daemontest.Ctx(t), begin); status.Code(err) != codes.AlreadyExists || ckptd.Reason(err) != "STEP_COMMITTED" {
		t.Fatalf("BeginSave of a step this daemon committed: %v", err)
	}
	// Known to storage only (another sidecar of the store): refused at
	// CommitSave, and the region goes back.
	other := daemontest.StartEnv(t, store, srv.Env(), "--shutdown-grace", "1s").Client()
	lease, err := other.API().BeginSave(daemontest.Ctx(t), begin)
	if err != nil {
		t.Fatalf("BeginSave on a sidecar that never saw the step: %v", err)
	}
	_, err = other.API().CommitSave(daemontest.Ctx(t), &pb.CommitSaveRequest{LeaseId: lease.GetLease().GetId()})
	if status.Code(err) != codes.AlreadyExists || ckptd.Reason(err) != "STEP_COMMITTED" || ckptd.ReasonMetadata(err)["attempt"] != daemontest.Attempt {
		t.Fatalf("CommitSave of a step only storage knows committed: %v", err)
	}
	if _, err := other.API().AbortSave(daemontest.Ctx(t), &pb.AbortSaveRequest{LeaseId: lease.GetLease().GetId()}); status.Code(err) != codes.NotFound {
		t.Fatalf("the refused save's lease is still open: %v", err)
	}

	srv.Freeze()
	t.Cleanup(srv.Thaw)
	daemontest.Save(t, c, daemontest.Shard(100, 0, 1)) // the first may wait: storage is not known down yet
	down := saves(101)
	t.Logf("%d saves: %v with storage up, %v with it frozen", n, up, down)
	if down > up+n*storageLook/2 {
		t.Fatalf("%d saves took %v with storage frozen, %v with it up: saves wait for storage", n, down, up)
	}
}
