package server

import (
	"context"
	"errors"
	"strconv"
	"unicode/utf8"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/prefetch"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
)

// ErrorDomain is the domain of the google.rpc.ErrorInfo every error status
// carries. Clients decide by its reason, never by the message text.
const ErrorDomain = "ckptd.io"

// classes maps core errors to a gRPC code and an ErrorInfo reason, first
// match wins: the more specific sentinels come before the general ones.
var classes = []struct {
	err    error
	code   codes.Code
	reason pb.ErrorReason
}{
	{checkpoint.ErrInvalid, codes.InvalidArgument, pb.ErrorReason_INVALID},
	{storage.ErrInvalidName, codes.InvalidArgument, pb.ErrorReason_INVALID},
	{prefetch.ErrInvalid, codes.InvalidArgument, pb.ErrorReason_INVALID},
	{checkpoint.ErrStepNotFound, codes.NotFound, pb.ErrorReason_STEP_NOT_FOUND},
	{staging.ErrUnknownLease, codes.NotFound, pb.ErrorReason_UNKNOWN_LEASE},
	{prefetch.ErrUnknownSession, codes.NotFound, pb.ErrorReason_UNKNOWN_SESSION},
	// Before storage.ErrNotFound: an object a commit record names that is
	// missing is damage to a committed step, not an unknown step.
	{checkpoint.ErrCorrupt, codes.DataLoss, pb.ErrorReason_CORRUPT},
	{prefetch.ErrCorruptShard, codes.DataLoss, pb.ErrorReason_CORRUPT},
	{storage.ErrNotFound, codes.NotFound, pb.ErrorReason_STEP_NOT_FOUND},
	{storage.ErrSymlink, codes.FailedPrecondition, pb.ErrorReason_STORE_UNSAFE},
	// The store refuses the daemon's credentials, or its bucket is gone:
	// the daemon's configuration, not the request, needs fixing.
	{s3.ErrAccessDenied, codes.FailedPrecondition, pb.ErrorReason_STORAGE_MISCONFIGURED},
	{s3.ErrNoSuchBucket, codes.FailedPrecondition, pb.ErrorReason_STORAGE_MISCONFIGURED},
	{staging.ErrOverBudget, codes.ResourceExhausted, pb.ErrorReason_OVER_BUDGET},
	{prefetch.ErrOverBudget, codes.ResourceExhausted, pb.ErrorReason_OVER_BUDGET},
	{prefetch.ErrTooLarge, codes.ResourceExhausted, pb.ErrorReason_TOO_LARGE},
	{prefetch.ErrNotAllowed, codes.PermissionDenied, pb.ErrorReason_PERMISSION_DENIED},
	{staging.ErrArenaTooLarge, codes.ResourceExhausted, pb.ErrorReason_TOO_LARGE},
	{arena.ErrTooLarge, codes.ResourceExhausted, pb.ErrorReason_TOO_LARGE},
	{staging.ErrArenaFull, codes.ResourceExhausted, pb.ErrorReason_ARENA_FULL},
	{arena.ErrFull, codes.ResourceExhausted, pb.ErrorReason_ARENA_FULL},
	{storage.ErrNoSpace, codes.ResourceExhausted, pb.ErrorReason_STORAGE_FULL},
	{storage.ErrUnavailable, codes.Unavailable, pb.ErrorReason_STORAGE_UNAVAILABLE},
	{staging.ErrClosing, codes.Unavailable, pb.ErrorReason_SHUTTING_DOWN},
	{prefetch.ErrClosed, codes.Unavailable, pb.ErrorReason_SHUTTING_DOWN},
	{arena.ErrClosed, codes.Unavailable, pb.ErrorReason_SHUTTING_DOWN},
	{context.DeadlineExceeded, codes.DeadlineExceeded, pb.ErrorReason_DEADLINE},
	{context.Canceled, codes.Canceled, pb.ErrorReason_CANCELLED},
}

// toStatus maps core errors (checkpoint, prefetch, arena, storage) to a
// gRPC status with the core's message and an ErrorInfo saying which kind
// of error it is, with the fields a client may act on. Both services use
// it.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok && !isCore(err) {
		return err // already a status (the stream's own errors)
	}
	code, reason, meta := classify(err)
	return withInfo(code, Explain(err), reason, meta)
}

// classify returns the gRPC code, ErrorInfo reason and metadata of a core
// error (INTERNAL when it is none of the core's).
func classify(err error) (codes.Code, pb.ErrorReason, map[string]string) {
	code, reason, meta := codes.Internal, pb.ErrorReason_INTERNAL, map[string]string{}
	var committed *checkpoint.CommittedError
	var inProgress *staging.InProgressError
	var chunk *checkpoint.ChunkError
	if errors.As(err, &chunk) {
		meta["step"], meta["rank"], meta["chunk"] = strconv.FormatInt(chunk.Step, 10), strconv.Itoa(chunk.Rank), strconv.Itoa(chunk.Chunk)
	}
	var shard *prefetch.ShardError
	if errors.As(err, &shard) && utf8.ValidString(shard.Shard) {
		meta["shard"] = shard.Shard
	}
	switch {
	case errors.As(err, &committed):
		code, reason = codes.AlreadyExists, pb.ErrorReason_STEP_COMMITTED
		meta["job"], meta["step"], meta["attempt"] = committed.Job, strconv.FormatInt(committed.Step, 10), committed.Attempt
	case errors.As(err, &inProgress):
		t := inProgress.Target
		code, reason = codes.AlreadyExists, pb.ErrorReason_SAVE_IN_PROGRESS
		meta["job"], meta["step"], meta["rank"], meta["attempt"] = t.Job, strconv.FormatInt(t.Step, 10), strconv.Itoa(t.Rank), t.Attempt
		meta["state"] = inProgress.State.String()
	default:
		for _, c := range classes {
			if errors.Is(err, c.err) {
				code, reason = c.code, c.reason
				break
			}
		}
	}
	return code, reason, meta
}

// isCore reports whether err wraps an error of the core, which toStatus
// classifies even when a status is also in the chain.
func isCore(err error) bool {
	var committed *checkpoint.CommittedError
	if errors.As(err, &committed) {
		return true
	}
	for _, c := range classes {
		if errors.Is(err, c.err) {
			return true
		}
	}
	return false
}

func withInfo(code codes.Code, msg string, reason pb.ErrorReason, meta map[string]string) error {
	st := status.New(code, msg)
	if len(meta) == 0 {
		meta = nil
	}
	if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reason.String(), Domain: ErrorDomain, Metadata: meta}); err == nil {
		st = d
	}
	return st.Err()
}
