package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
	"github.com/ckptd/ckptd/storage/s3"
)

// storageOptions are the flags every command that touches storage takes.
type storageOptions struct {
	URL        string
	Job        string
	S3Endpoint string
	S3Region   string
	S3Retry    time.Duration
	S3Stall    time.Duration
	FileMode   fileMode
	// interactive: a person waits (list, restore, verify, prune): a dead
	// store fails within a short deadline, in one line, not one warning
	// per retry.
	interactive bool
}

// Retry deadlines for S3: the daemon rides out outages (its saves wait in
// the arena); a person at a prompt wants an answer.
const (
	daemonS3Retry      = 2 * time.Minute
	interactiveS3Retry = 15 * time.Second
	interactiveS3Stall = 10 * time.Second
)

// register adds the storage flags for the daemon.
func (o *storageOptions) register(fs *pflag.FlagSet) { o.registerFor(fs, false) }

// registerInteractive adds them for a command a person waits on.
func (o *storageOptions) registerInteractive(fs *pflag.FlagSet) { o.registerFor(fs, true) }

func (o *storageOptions) registerFor(fs *pflag.FlagSet, interactive bool) {
	o.interactive = interactive
	retry, stall := daemonS3Retry, s3.DefaultStallTimeout
	if interactive {
		retry, stall = interactiveS3Retry, interactiveS3Stall
	}
	fs.StringVar(&o.URL, "storage", defaultStorage(), "storage URL: file:///path, a plain path, or s3://bucket/prefix")
	fs.StringVar(&o.Job, "job", "default", "job name (a folder under the storage root)")
	fs.StringVar(&o.S3Endpoint, "s3-endpoint", "", "S3 endpoint URL, e.g. http://127.0.0.1:9000 (env AWS_ENDPOINT_URL too)")
	fs.StringVar(&o.S3Region, "s3-region", "", "S3 region")
	fs.DurationVar(&o.S3Retry, "s3-retry-deadline", retry, "how long one S3 request is retried through throttling, 5xx and resets before it fails")
	fs.DurationVar(&o.S3Stall, "s3-stall-timeout", stall, "an S3 request that moves no bytes for this long (a frozen endpoint) is cancelled and retried")
	o.FileMode = fileMode(posix.DefaultFileMode)
	fs.Var(&o.FileMode, "file-mode", "mode of the files written to a directory store, whatever the umask: 0600, 0640 or 0644 (folders get x where r is set)")
}

// fileMode is a flag value that takes an octal mode such as 0640.
type fileMode fs.FileMode

func (m *fileMode) String() string { return fmt.Sprintf("%#o", uint32(*m)) }
func (m *fileMode) Type() string   { return "octal" }

func (m *fileMode) Set(s string) error {
	v, err := posix.ParseFileMode(s)
	if err != nil {
		return err
	}
	*m = fileMode(v)
	return nil
}

// defaultStorage is where `ckptd serve` keeps checkpoints when given no
// --storage, so that it works out of the box: $XDG_DATA_HOME/ckptd or
// ~/.local/share/ckptd.
func defaultStorage() string {
	if d := os.Getenv("XDG_DATA_HOME"); d != "" {
		return filepath.Join(d, "ckptd")
	}
	if h, err := os.UserHomeDir(); err == nil {
		return filepath.Join(h, ".local", "share", "ckptd")
	}
	return filepath.Join(os.TempDir(), "ckptd-data")
}

func (o *storageOptions) open(ctx context.Context, create bool) (storage.Backend, error) {
	return openStorage(ctx, o.URL, o, create)
}

// stepChoice is the step a command reads: Step, or with Latest the
// newest whose every rank reads, and with Finite too the newest of those
// whose tensors hold no NaN or Inf.
type stepChoice struct {
	Step           int64
	Latest, Finite bool
}

// registerStep adds --step, --latest and --finite for a command that
// does verb to a step.
func (c *stepChoice) register(fs *pflag.FlagSet, verb string) {
	fs.Int64Var(&c.Step, "step", 0, "step to "+verb)
	fs.BoolVar(&c.Latest, "latest", false, verb+" the newest committed step")
	fs.BoolVar(&c.Finite, "finite", false, "with --latest: the newest committed step whose tensors hold no NaN or Inf (a run that diverged), naming the newer steps passed over")
}

// check refuses anything but exactly one of --step and --latest, and
// --finite without --latest.
func (c *stepChoice) check(fs *pflag.FlagSet) error {
	switch {
	case fs.Changed("step") == c.Latest:
		return usageError{errors.New("give exactly one of --step N and --latest")}
	case c.Finite && !c.Latest:
		return usageError{errors.New("--finite picks among steps for --latest: give --latest, not --step")}
	}
	return nil
}

// openStep opens the job's Store and resolves the chosen committed step in
// it, saying on warn which steps --finite passed over; close closes the
// store. For every rank (whole), latest is the newest step whose every
// rank reads; for one rank it is the newest committed step, read from its
// commit record alone, as a trainer's load of latest is: a job of
// thousands of ranks does not read them all to restore one.
func (o *storageOptions) openStep(ctx context.Context, c stepChoice, whole bool, warn io.Writer) (*checkpoint.Store, *checkpoint.CommitRecord, func(), error) {
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return nil, nil, nil, err
	}
	var rec *checkpoint.CommitRecord
	switch {
	case c.Finite:
		var skipped []int64
		if whole {
			rec, skipped, err = store.LatestWholeFinite(ctx)
		} else {
			rec, skipped, err = store.LatestFinite(ctx)
		}
		if err == nil && len(skipped) > 0 {
			fmt.Fprintf(warn, "ckptd: passed over steps %v, whose tensors hold NaN or Inf; using step %d\n", skipped, rec.Step)
		}
	case whole:
		rec, err = store.ResolveWhole(ctx, c.Step, c.Latest)
	default:
		rec, err = store.Resolve(ctx, c.Step, c.Latest)
	}
	if err != nil {
		closeStore()
		return nil, nil, nil, err
	}
	return store, rec, closeStore, nil
}

// openStore opens the backend and a Store for the job.
func (o *storageOptions) openStore(ctx context.Context) (*checkpoint.Store, func(), error) {
	b, err := o.open(ctx, false)
	if err != nil {
		return nil, nil, err
	}
	s, err := checkpoint.NewStore(b, o.Job)
	if err != nil {
		b.Close()
		return nil, nil, usageError{err}
	}
	return s, func() { b.Close() }, nil
}

// byteSize is a flag value that accepts 1073741824, 1GiB, 512MiB, 4k, 2G.
type byteSize int64

// String is the size in the largest binary unit that divides it (1GiB,
// 512MiB), else the largest decimal one (5GB), as help shows defaults and
// as Set reads them back.
func (b *byteSize) String() string { return formatBytes(int64(*b)) }

func formatBytes(n int64) string {
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}} {
		if n != 0 && n%u.mult == 0 {
			return strconv.FormatInt(n/u.mult, 10) + u.suffix
		}
	}
	return strconv.FormatInt(n, 10)
}
func (b *byteSize) Type() string { return "bytes" }

func (b *byteSize) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b = byteSize(n)
	return nil
}

var units = []struct {
	suffix string
	mult   int64
}{
	{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
	{"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
	{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"t", 1 << 40}, {"b", 1},
}

func parseBytes(s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseFloat(t, 64)
	if err != nil || n < 0 || n*float64(mult) > 1<<62 {
		return 0, fmt.Errorf("invalid size %q (want e.g. 1073741824, 512MiB, 8GiB)", s)
	}
	return int64(n * float64(mult)), nil
}
