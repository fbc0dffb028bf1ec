package server

import (
	"context"
	"strconv"

	"google.golang.org/grpc/codes"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/peercred"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// allowed refuses a call of a peer the socket's policy does not allow
// (see peercred), with PERMISSION_DENIED naming its uid and the fix; the
// intake's tap asks it of every call before anything of it is read.
// Calls that did not come through a peercred listener (in-process tests)
// pass.
func allowed(ctx context.Context) error {
	info, ok := peercred.FromContext(ctx)
	if !ok || info.Allowed() {
		return nil
	}
	return withInfo(codes.PermissionDenied, "permission denied: "+info.Refused, pb.ErrorReason_PERMISSION_DENIED,
		map[string]string{"uid": strconv.Itoa(info.UID)})
}

// owner is the checkpoint core's view of the connection a call came on.
func owner(ctx context.Context) staging.Owner {
	info, ok := peercred.FromContext(ctx)
	if !ok {
		return staging.Owner{}
	}
	return staging.Owner{ID: info.ID, Done: info.Done(), Exited: info.Exited, Peer: peerName(info)}
}
