//go:build linux

package ckptd

import (
	"testing"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Every reason the proto lists is matched by a sentinel, but those that
// match by their gRPC code alone: a reason added to the proto fails here
// until the client knows it.
func TestEveryReasonMatches(t *testing.T) {
	byCodeOnly := map[pb.ErrorReason]bool{pb.ErrorReason_ERROR_REASON_UNSPECIFIED: true,
		pb.ErrorReason_DEADLINE: true, pb.ErrorReason_CANCELLED: true, pb.ErrorReason_INTERNAL: true}
	for v, name := range pb.ErrorReason_name {
		if r := pb.ErrorReason(v); !byCodeOnly[r] && reasonErr(name) == nil {
			t.Errorf("reason %s matches no sentinel", name)
		}
	}
	if reasonErr("NOT_A_REASON") != nil {
		t.Error("an unknown reason matched a sentinel")
	}
}
