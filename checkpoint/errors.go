package checkpoint

import (
	"errors"
	"fmt"
)

// Errors of the format and its operations, which callers match with
// errors.Is; the server maps each to a gRPC code.
var (
	// ErrInvalid: a request or name is malformed. Nothing was changed.
	ErrInvalid = errors.New("invalid request")
	// ErrStepNotFound: the step is not committed (or does not exist).
	ErrStepNotFound = errors.New("step not found")
	// ErrExists: the step is already committed, or the rank is already
	// being saved. CommittedError and InProgressError say which.
	ErrExists = errors.New("already exists")
	// ErrCorrupt: stored data or a manifest failed verification.
	ErrCorrupt = errors.New("corrupt checkpoint data")
)

// CommittedError says a step is committed already, and by which attempt.
// It matches ErrExists.
type CommittedError struct {
	Job     string
	Step    int64
	Attempt string // the committed attempt ("" for a format-1 step)
	Mine    bool   // the attempt asking is the one that committed it
	Detail  string // why the save was refused, if more than that
}

func (e *CommittedError) Error() string {
	by := "by another attempt"
	switch {
	case e.Attempt == "":
		by = "by a run before attempts existed"
	case e.Mine:
		by = fmt.Sprintf("by this attempt (%q)", e.Attempt)
	default:
		by = fmt.Sprintf("by attempt %q", e.Attempt)
	}
	msg := fmt.Sprintf("step %d of job %q was already committed %s", e.Step, e.Job, by)
	if e.Detail != "" {
		msg += "; " + e.Detail
	}
	return msg
}

// Is makes a CommittedError match ErrExists.
func (e *CommittedError) Is(target error) bool { return target == ErrExists }
