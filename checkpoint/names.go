package checkpoint

import (
	"fmt"
	"strings"
)

// Limits on identifiers. Steps have 12 digits and ranks 5 in object names.
const (
	MaxNameLen   = 255
	MaxStep      = 999_999_999_999
	MaxWorldSize = 100_000
)

// ValidateName checks a job or tensor name: non-empty, at most 255 bytes,
// and free of "/", "..", NUL and other control bytes, so that it can never
// escape its folder or confuse a reader of the manifest.
func ValidateName(kind, name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty %s name", ErrInvalid, kind)
	case len(name) > MaxNameLen:
		return fmt.Errorf("%w: %s name is %d bytes, more than %d", ErrInvalid, kind, len(name), MaxNameLen)
	case strings.Contains(name, "/"), strings.Contains(name, ".."), name == ".":
		return fmt.Errorf("%w: %s name %q contains \"/\" or \"..\"", ErrInvalid, kind, name)
	}
	for _, c := range []byte(name) {
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: %s name %q contains a control byte (0x%02x)", ErrInvalid, kind, name, c)
		}
	}
	return nil
}

// Target names one rank's shard of one step.
type Target struct {
	Job       string
	Step      int64
	Rank      int
	WorldSize int
}

func (t Target) String() string {
	return fmt.Sprintf("job %q step %d rank %d/%d", t.Job, t.Step, t.Rank, t.WorldSize)
}

// Validate checks the job name and the step, rank and world size ranges.
func (t Target) Validate() error {
	if err := ValidateName("job", t.Job); err != nil {
		return err
	}
	if err := validateStep(t.Step); err != nil {
		return err
	}
	if t.WorldSize < 1 || t.WorldSize > MaxWorldSize {
		return fmt.Errorf("%w: world_size %d out of range [1, %d]", ErrInvalid, t.WorldSize, MaxWorldSize)
	}
	if t.Rank < 0 || t.Rank >= t.WorldSize {
		return fmt.Errorf("%w: rank %d out of range [0, world_size %d)", ErrInvalid, t.Rank, t.WorldSize)
	}
	return nil
}

func validateStep(step int64) error {
	if step < 0 || step > MaxStep {
		return fmt.Errorf("%w: step %d out of range [0, %d]", ErrInvalid, step, int64(MaxStep))
	}
	return nil
}

// Object names, relative to the store root. Within a manifest, chunk objects
// are relative to the job folder (jobRelative) so they survive a job rename.

func stepDir(job string, step int64) string {
	return stepsPrefix(job) + stepSegment(step) + "/"
}

// stepSegment is a step's folder name: 12 digits, so that lexical order is
// numeric order.
func stepSegment(step int64) string { return fmt.Sprintf("%012d", step) }

func stepsPrefix(job string) string { return job + "/steps/" }

func dataObject(step int64, rank int) string {
	return fmt.Sprintf("steps/%012d/rank-%05d.data", step, rank)
}

func manifestName(job string, step int64, rank int) string {
	return fmt.Sprintf("%srank-%05d.manifest.json", stepDir(job, step), rank)
}

func commitName(job string, step int64) string {
	return stepDir(job, step) + commitFile
}

const (
	commitFile     = "COMMIT.json"
	manifestSuffix = ".manifest.json"
)

// inJob turns a job-relative object name into a store name.
func inJob(job, rel string) string { return job + "/" + rel }
