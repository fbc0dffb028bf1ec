// Package budget names the bounds an operator sets on the daemon (its
// arena, the tensor tables' memory, the hot tier, the datasets' share of
// the arena, ...), so that the core packages can say which one refused a
// request without knowing how it is set. A core error carries the budgets
// it ran into (Wrap); the daemon's adapters, which know the settings, name
// them when they show the error to a person (Of): ckptd serve's flags.
package budget

import "errors"

// Name is one configured bound.
type Name int

// The bounds, each set by one setting of ckptd serve.
const (
	StagingArena   Name = iota + 1 // the shared-memory staging arena
	TensorTables                   // memory for open saves' tensor tables and restores
	Restores                       // restores reading from storage at once
	HotTier                        // memory for the hot tier
	PersistPolicy                  // which steps go to storage, which stay in memory
	DatasetShare                   // the datasets' share of the arena
	RingSlots                      // batches a dataset session delivers ahead
	SlotBytes                      // a ring slot's size
	ReadAhead                      // memory a dataset session may hold
	DatasetListing                 // memory a dataset's listing may take
	DatasetSources                 // the sources datasets may be read from
	DiskCache                      // the datasets' disk tier: its folder and size
)

// Error is a core error that ran into budgets. Its message names them by
// what they bound, never by how they are set.
type Error struct {
	Budgets []Name
	Err     error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Wrap marks err (nil stays nil) as having run into names.
func Wrap(err error, names ...Name) error {
	if err == nil {
		return nil
	}
	return &Error{Budgets: names, Err: err}
}

// Of returns the budgets err ran into, outermost first, each once.
func Of(err error) []Name {
	var out []Name
	seen := map[Name]bool{}
	for err != nil {
		var e *Error
		if !errors.As(err, &e) {
			break
		}
		for _, n := range e.Budgets {
			if !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
		err = e.Err
	}
	return out
}
