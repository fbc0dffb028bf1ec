package checkpoint

import "errors"

// Errors callers match with errors.Is; the server maps each to a gRPC code.
var (
	// ErrInvalid: a request or name is malformed. Nothing was changed.
	ErrInvalid = errors.New("invalid request")
	// ErrStepNotFound: the step is not committed (or does not exist).
	ErrStepNotFound = errors.New("step not found")
	// ErrExists: the step is already committed, or the rank is already
	// being saved.
	ErrExists = errors.New("already exists")
	// ErrCorrupt: stored data or a manifest failed verification.
	ErrCorrupt = errors.New("corrupt checkpoint data")
	// ErrUnknownLease: no lease of that id (expired, released, or never
	// granted).
	ErrUnknownLease = errors.New("unknown lease")
)
