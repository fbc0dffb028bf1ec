package server

import (
	"context"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/peercred"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Interceptors refuse every call of a peer the socket's policy does not
// allow (see peercred), with PERMISSION_DENIED naming its uid and the fix.
// Calls that did not come through a peercred listener (in-process tests)
// pass.
func Interceptors() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if err := allowed(ctx); err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if err := allowed(ss.Context()); err != nil {
				return err
			}
			return h(srv, ss)
		}),
	}
}

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
