package checkpoint

import (
	"errors"
	"fmt"
)

// Errors callers match with errors.Is; the server maps each to a gRPC code.
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
	// ErrUnknownLease: no lease of that id (expired, released, never
	// granted, or another connection's).
	ErrUnknownLease = errors.New("unknown lease")
	// ErrOverBudget: the memory set aside for open saves' tensor tables
	// (ManagerConfig.TableBudget) is used up.
	ErrOverBudget = errors.New("over budget")
	// ErrArenaFull: no region of the staging arena came free within
	// ManagerConfig.StagingWait (or the crash fence outlasted it).
	ErrArenaFull = errors.New("arena full")
	// ErrArenaTooLarge: the region asked for is larger than the whole
	// staging arena.
	ErrArenaTooLarge = errors.New("arena: request larger than the arena")
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

// InProgressError says this daemon is already saving the same rank of
// the same step for the same attempt.
type InProgressError struct {
	Target Target
	State  State
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("already exists: %s is already being saved (%s)", e.Target, e.State)
}

// Is makes an InProgressError match ErrExists.
func (e *InProgressError) Is(target error) bool { return target == ErrExists }
