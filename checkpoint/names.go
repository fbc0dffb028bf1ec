package checkpoint

import (
	"fmt"
	"hash/crc32"
	"log/slog"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ckptd/ckptd/checkpoint/attempt"
)

// Limits on identifiers. Steps have 12 digits and ranks 5 in object names.
const (
	MaxNameLen   = 255
	MaxStep      = 999_999_999_999
	MaxWorldSize = 100_000
	// LegacyAttempt is the attempt of a save journaled by a daemon that
	// predates attempts (its entry names none): the save was acknowledged,
	// so it is drained, under this fixed id, which every upgraded sidecar
	// gives such saves, so the ranks of one step journaled before an
	// upgrade still commit together.
	LegacyAttempt = "legacy"
	// MaxAttemptLen bounds an attempt id, which is a folder name.
	MaxAttemptLen = attempt.MaxLen
)

// reservedTensorNames are names a safetensors file cannot hold as tensors
// (its header keeps "__metadata__" for itself): a save that used one would
// commit a step that `ckptd restore` cannot write.
var reservedTensorNames = map[string]bool{"__metadata__": true}

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
	case !utf8.ValidString(name):
		return fmt.Errorf("%w: %s name %q is not valid UTF-8", ErrInvalid, kind, name)
	case kind == "tensor" && reservedTensorNames[name]:
		return fmt.Errorf("%w: tensor name %q is reserved by the safetensors format that restore writes; rename the tensor", ErrInvalid, name)
	}
	for _, c := range []byte(name) {
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: %s name %q contains a control byte (0x%02x)", ErrInvalid, kind, name, c)
		}
	}
	return nil
}

// ValidateAttempt checks an attempt id: 1 to 64 bytes of [a-z0-9._-], not
// starting with a dot. It names a folder under the step, so it must not be
// able to climb out of it or hide.
func ValidateAttempt(a string) error {
	if a == "" {
		return fmt.Errorf("%w: the save names no attempt (the run of the job it belongs to); "+
			"set CKPTD_ATTEMPT or upgrade the client, which sets one", ErrInvalid)
	}
	if err := attempt.Check(a); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// Target names one rank's shard of one step, saved by one attempt (run)
// of the job. Attempt is empty only for steps written before attempts
// existed (manifest and commit format 1).
//
// Its JSON form (field names as in Go) is part of the staging journal.
type Target struct {
	Job       string
	Step      int64
	Rank      int
	WorldSize int
	Attempt   string
}

func (t Target) String() string {
	s := fmt.Sprintf("job %q step %d rank %d/%d", t.Job, t.Step, t.Rank, t.WorldSize)
	if t.Attempt != "" {
		s += fmt.Sprintf(" attempt %q", t.Attempt)
	}
	return s
}

// LogValue logs a target as a group with stable keys (job, step, rank,
// world_size, attempt), which JSON logs index.
func (t Target) LogValue() slog.Value {
	return slog.GroupValue(slog.String("job", t.Job), slog.Int64("step", t.Step), slog.Int("rank", t.Rank),
		slog.Int("world_size", t.WorldSize), slog.String("attempt", t.Attempt))
}

// Validate checks a save's target: the job name, the step, rank and world
// size ranges, and the attempt, which a new save must name.
func (t Target) Validate() error {
	if err := ValidateAttempt(t.Attempt); err != nil {
		return err
	}
	return t.validateStored()
}

// validateStored is Validate for a target read back from storage, where a
// format-1 object has no attempt.
func (t Target) validateStored() error {
	if t.Attempt != "" {
		if err := ValidateAttempt(t.Attempt); err != nil {
			return err
		}
	}
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

// parseStepSegment reads a step's folder name, exactly as stepSegment
// writes it; false for anything else.
func parseStepSegment(seg string) (int64, bool) {
	step, err := strconv.ParseInt(seg, 10, 64)
	if err != nil || validateStep(step) != nil || stepSegment(step) != seg {
		return -1, false
	}
	return step, true
}

func stepsPrefix(job string) string { return job + "/steps/" }

// attemptDir is the folder of one attempt's objects of a step, relative to
// the job; a format-1 step (no attempt) keeps them in the step folder.
func attemptDir(step int64, attempt string) string {
	if attempt == "" {
		return fmt.Sprintf("steps/%012d/", step)
	}
	return fmt.Sprintf("steps/%012d/%s/", step, attempt)
}

// dataObject is a rank's chunk data, relative to the job.
func (t Target) dataObject() string {
	return fmt.Sprintf("%srank-%05d.data", attemptDir(t.Step, t.Attempt), t.Rank)
}

// spreadDataObject is where a rank's chunk data goes, relative to the job,
// when the writer spreads data over prefixes (WriterOptions.SpreadData):
// steps/spread-<hh>/<step>/<attempt>/rank-<rank>.data, hh two hex digits
// of a hash of the rank alone. A step's data objects then fall in 256 key
// ranges, the same ones step after step, which S3 scales out under
// sustained load; its manifests and COMMIT.json stay in the step folder,
// and readers find the data through the manifests.
func (t Target) spreadDataObject() string {
	return fmt.Sprintf("steps/%s%02x/%srank-%05d.data", spreadPrefix, spreadOf(t.Rank), attemptDir(t.Step, t.Attempt)[len("steps/"):], t.Rank)
}

// spreadOf is rank's spread folder: the low byte of the CRC-32 (IEEE) of
// its 5 digits. Nothing recomputes it (readers follow manifests, prune and
// delete list): it only has to scatter ranks.
func spreadOf(rank int) byte {
	return byte(crc32.ChecksumIEEE(fmt.Appendf(nil, "%05d", rank)))
}

// manifestObject is a rank's manifest, relative to the job.
func (t Target) manifestObject() string {
	return fmt.Sprintf("%srank-%05d%s", attemptDir(t.Step, t.Attempt), t.Rank, manifestSuffix)
}

// manifestName is a rank's manifest in the store.
func (t Target) manifestName() string {
	return inJob(t.Job, t.manifestObject())
}

func commitName(job string, step int64) string {
	return stepDir(job, step) + commitFile
}

const (
	commitFile     = "COMMIT.json"
	manifestSuffix = ".manifest.json"
	spreadPrefix   = "spread-"
)

// inJob turns a job-relative object name into a store name.
func inJob(job, rel string) string { return job + "/" + rel }
