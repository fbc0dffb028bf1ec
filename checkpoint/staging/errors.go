package staging

import (
	"errors"
	"fmt"

	"github.com/ckptd/ckptd/checkpoint"
)

// Errors of the daemon's staging runtime, which callers match with
// errors.Is; the server maps each to a gRPC code.
var (
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

// InProgressError says this daemon is already saving the same rank of
// the same step for the same attempt.
type InProgressError struct {
	Target checkpoint.Target
	State  State
}

func (e *InProgressError) Error() string {
	return fmt.Sprintf("already exists: %s is already being saved (%s)", e.Target, e.State)
}

// Is makes an InProgressError match ErrExists.
func (e *InProgressError) Is(target error) bool { return target == checkpoint.ErrExists }
