package ckptd

import (
	"errors"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"
)

// Reason returns why the daemon refused a call: the reason of the
// google.rpc.ErrorInfo its error carries ("STEP_COMMITTED",
// "SAVE_IN_PROGRESS", "ARENA_FULL", ...; the list is in the proto), or ""
// when err carries none. Decide on it, not on the message text.
func Reason(err error) string {
	info := errorInfo(err)
	if info == nil {
		return ""
	}
	return info.GetReason()
}

// ReasonMetadata returns the fields of the daemon's ErrorInfo (job, step,
// rank, attempt, ...), or nil.
func ReasonMetadata(err error) map[string]string {
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
