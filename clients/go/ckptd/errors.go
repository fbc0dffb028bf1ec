//go:build linux

package ckptd

import (
	"errors"
	"fmt"
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Reason returns why the daemon refused a call: the reason of the
// google.rpc.ErrorInfo its error carries, the name of one of the proto's
// ErrorReason values ("STEP_COMMITTED", "SAVE_IN_PROGRESS", "ARENA_FULL",
// ...), or "" when err carries none (a failed save's Wait carries one
// too). Decide on it, not on the message text.
func Reason(err error) string {
	if f, ok := errors.AsType[*SaveFailure](err); ok {
		return f.Reason
	}
	info := errorInfo(err)
	if info == nil {
		return ""
	}
	return info.GetReason()
}

// ReasonMetadata returns the fields of the daemon's ErrorInfo (job, step,
// rank, attempt, ...), or nil.
func ReasonMetadata(err error) map[string]string {
	if f, ok := errors.AsType[*SaveFailure](err); ok {
		return f.Metadata
	}
	return errorInfo(err).GetMetadata()
}

func errorInfo(err error) *errdetails.ErrorInfo {
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		return nil
	}
	for _, d := range se.GRPCStatus().Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			return info
		}
	}
	return nil
}

// Errors a call can be matched against with errors.Is, by the daemon's
// reason (see Reason); a call that failed without one matches by its gRPC
// code where the code is unambiguous.
var (
	ErrInvalid            = errors.New("invalid request")           // INVALID
	ErrNotFound           = errors.New("not found")                 // STEP_NOT_FOUND, UNKNOWN_LEASE, UNKNOWN_SESSION
	ErrStepCommitted      = errors.New("step already committed")    // STEP_COMMITTED
	ErrSaveInProgress     = errors.New("save already in progress")  // SAVE_IN_PROGRESS
	ErrResourceExhausted  = errors.New("resource exhausted")        // ARENA_FULL, TOO_LARGE, OVER_BUDGET, STORAGE_FULL
	ErrCorrupt            = errors.New("corrupt data")              // CORRUPT
	ErrStorageUnavailable = errors.New("storage unavailable")       // STORAGE_UNAVAILABLE
	ErrDaemonUnavailable  = errors.New("daemon unavailable")        // SHUTTING_DOWN, or no daemon on the socket
	ErrPermissionDenied   = errors.New("permission denied")         // PERMISSION_DENIED
	ErrStoreUnsafe        = errors.New("storage refused as unsafe") // STORE_UNSAFE
	// ErrStorageMisconfigured: the store refuses the daemon's credentials
	// or its bucket is missing; the daemon's configuration needs fixing.
	ErrStorageMisconfigured = errors.New("storage misconfigured") // STORAGE_MISCONFIGURED
)

// byReason is what each of the proto's ErrorReason values matches; the
// ones not here (DEADLINE, CANCELLED, INTERNAL) match by code.
var byReason = map[pb.ErrorReason]error{
	pb.ErrorReason_INVALID: ErrInvalid, pb.ErrorReason_STEP_NOT_FOUND: ErrNotFound,
	pb.ErrorReason_UNKNOWN_LEASE: ErrNotFound, pb.ErrorReason_UNKNOWN_SESSION: ErrNotFound,
	pb.ErrorReason_STEP_COMMITTED: ErrStepCommitted, pb.ErrorReason_SAVE_IN_PROGRESS: ErrSaveInProgress,
	pb.ErrorReason_ARENA_FULL: ErrResourceExhausted, pb.ErrorReason_TOO_LARGE: ErrResourceExhausted,
	pb.ErrorReason_OVER_BUDGET: ErrResourceExhausted, pb.ErrorReason_STORAGE_FULL: ErrResourceExhausted,
	pb.ErrorReason_CORRUPT: ErrCorrupt, pb.ErrorReason_STORAGE_UNAVAILABLE: ErrStorageUnavailable,
	pb.ErrorReason_SHUTTING_DOWN: ErrDaemonUnavailable, pb.ErrorReason_PERMISSION_DENIED: ErrPermissionDenied,
	pb.ErrorReason_STORE_UNSAFE: ErrStoreUnsafe, pb.ErrorReason_STORAGE_MISCONFIGURED: ErrStorageMisconfigured,
}

// reasonErr is what the reason named r matches (nil for one this client
// does not know).
func reasonErr(r string) error {
	v, ok := pb.ErrorReason_value[r]
	if !ok {
		return nil
	}
	return byReason[pb.ErrorReason(v)]
}

var byCode = map[codes.Code]error{
	codes.InvalidArgument: ErrInvalid, codes.NotFound: ErrNotFound, codes.ResourceExhausted: ErrResourceExhausted,
	codes.DataLoss: ErrCorrupt, codes.Unavailable: ErrDaemonUnavailable, codes.PermissionDenied: ErrPermissionDenied,
}

// callError is a failed call: it wraps the gRPC status error and matches
// the sentinel of its reason.
type callError struct {
	socket string
	err    error
}

func (e *callError) Error() string {
	if status.Code(e.err) == codes.Unavailable && Reason(e.err) == "" {
		// Nobody answered (no daemon, a crashed one): the socket is what
		// to check, as the Python client says.
		return fmt.Sprintf("no ckptd daemon answers on %s (%s); start one with `ckptd serve --socket %s` or set CKPTD_SOCKET",
			e.socket, dialCause(e.err), e.socket)
	}
	return "ckptd at " + e.socket + ": " + e.err.Error()
}

// dialCause is what a failed connection's status says went wrong, without
// gRPC's wrapping ("connection error: desc = transport: ...").
func dialCause(err error) string {
	msg := status.Convert(err).Message()
	if _, cause, ok := strings.Cut(msg, "Error while dialing: "); ok {
		return strings.TrimSuffix(cause, `"`)
	}
	return msg
}
func (e *callError) Unwrap() error { return e.err }

func (e *callError) Is(target error) bool {
	if r := Reason(e.err); r != "" {
		return reasonErr(r) == target
	}
	return byCode[status.Code(e.err)] == target
}
