//go:build linux

package ckptd

import (
	"errors"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Reason returns why the daemon refused a call: the reason of the
// google.rpc.ErrorInfo its error carries ("STEP_COMMITTED",
// "SAVE_IN_PROGRESS", "ARENA_FULL", ...; the list is in the proto), or ""
// when err carries none (a failed save's Wait carries one too). Decide on it, not on the message text.
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

var byReason = map[string]error{
	"INVALID": ErrInvalid, "STEP_NOT_FOUND": ErrNotFound, "UNKNOWN_LEASE": ErrNotFound, "UNKNOWN_SESSION": ErrNotFound,
	"STEP_COMMITTED": ErrStepCommitted, "SAVE_IN_PROGRESS": ErrSaveInProgress,
	"ARENA_FULL": ErrResourceExhausted, "TOO_LARGE": ErrResourceExhausted, "OVER_BUDGET": ErrResourceExhausted,
	"STORAGE_FULL": ErrResourceExhausted, "CORRUPT": ErrCorrupt, "STORAGE_UNAVAILABLE": ErrStorageUnavailable,
	"SHUTTING_DOWN": ErrDaemonUnavailable, "PERMISSION_DENIED": ErrPermissionDenied, "STORE_UNSAFE": ErrStoreUnsafe,
	"STORAGE_MISCONFIGURED": ErrStorageMisconfigured,
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

func (e *callError) Error() string { return "ckptd at " + e.socket + ": " + e.err.Error() }
func (e *callError) Unwrap() error { return e.err }

func (e *callError) Is(target error) bool {
	if r := Reason(e.err); r != "" {
		return byReason[r] == target
	}
	return byCode[status.Code(e.err)] == target
}
