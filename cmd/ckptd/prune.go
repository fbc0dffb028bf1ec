package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
)

type pruneOptions struct {
	storageOptions
	KeepLast  int
	KeepEvery int64
	GCGrace   time.Duration
	DryRun    bool
}

func newPruneCmd() *cobra.Command {
	o := &pruneOptions{}
	cmd := &cobra.Command{
		Use:   "prune --keep-last N [--keep-every M] [--dry-run]",
		Short: "Delete all but the newest N committed steps, and attempts no commit record names",
		Long: `Delete all but the newest N committed steps and, with --keep-every M, the
steps whose number M divides (--keep-last 0 --keep-every 10000 keeps only
those). Also delete the attempts (runs of the job) that no commit record
names: those of committed steps at once (a crashed run's ranks), and those
of uncommitted steps once nothing was written to them for --gc-grace (they
may still be in flight before that; set it above the longest outage a save
may be held back through); and what writers killed mid-write left (POSIX
temporary files, S3 multipart uploads) once idle for --gc-grace too.
Objects a kept step points to are never deleted, and neither is a step whose
commit record is damaged (it is named, for a person to look at).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("keep-last") {
				return usageError{fmt.Errorf("--keep-last N is required")}
			}
			return runPrune(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	o.storageOptions.registerInteractive(cmd.Flags())
	cmd.Flags().IntVar(&o.KeepLast, "keep-last", 0, "committed steps to keep, the newest (0 only with --keep-every)")
	cmd.Flags().Int64Var(&o.KeepEvery, "keep-every", 0, "also keep every committed step whose number this divides (e.g. 10000)")
	cmd.Flags().DurationVar(&o.GCGrace, "gc-grace", time.Hour, "how long an uncommitted attempt is left alone after its last write")
	cmd.Flags().BoolVar(&o.DryRun, "dry-run", false, "print what would be deleted, delete nothing")
	return cmd
}

func runPrune(ctx context.Context, o *pruneOptions, out io.Writer) error {
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	switch {
	case o.GCGrace <= 0:
		return usageError{fmt.Errorf("--gc-grace must be positive, got %s", o.GCGrace)}
	case o.KeepEvery < 0:
		return usageError{fmt.Errorf("--keep-every must be positive, got %d", o.KeepEvery)}
	case o.KeepLast < 0 || o.KeepLast == 0 && o.KeepEvery == 0:
		return usageError{fmt.Errorf("--keep-last must be at least 1 (or 0 together with --keep-every), got %d", o.KeepLast)}
	}
	rep, err := store.Prune(ctx, checkpoint.PruneOptions{KeepLast: o.KeepLast, KeepEvery: o.KeepEvery, GCGrace: o.GCGrace, DryRun: o.DryRun})
	if errors.Is(err, checkpoint.ErrInvalid) {
		return usageError{err}
	}
	if err != nil {
		return err
	}
	verb := "removed"
	if o.DryRun {
		verb = "would remove"
	}
	garbage := make([]string, len(rep.Garbage))
	for i, g := range rep.Garbage {
		garbage[i] = fmt.Sprintf("%d/%s", g.Step, attemptLabel(g.Attempt))
	}
	fmt.Fprintf(out, "kept steps %v\n%s steps %v, uncommitted attempts [%s] and %d temporaries: %d objects, %s\n",
		rep.Kept, verb, rep.Removed, strings.Join(garbage, " "), len(rep.Temporaries), rep.Objects, human(rep.Bytes))
	if len(rep.Damaged) > 0 {
		fmt.Fprintf(out, "left alone: steps %v, whose commit record or a manifest is damaged (see the warnings above)\n", rep.Damaged)
	}
	if len(rep.Pinned) > 0 {
		fmt.Fprintf(out, "kept for now: steps %v, which incremental saves in flight reference (a later prune removes them)\n", rep.Pinned)
	}
	return nil
}

// attemptLabel names an attempt for people; objects written before
// attempts existed have none.
func attemptLabel(a string) string {
	if a == "" {
		return "(no attempt)"
	}
	return a
}
