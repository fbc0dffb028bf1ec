package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
)

type deleteOptions struct {
	storageOptions
	Step   int64
	Force  bool
	DryRun bool
}

func newDeleteCmd() *cobra.Command {
	o := &deleteOptions{}
	cmd := &cobra.Command{
		Use:   "delete (--step N | --job NAME) [--force] [--dry-run]",
		Short: "Delete one step of a job, or a whole job, from storage",
		Long: `Delete one step (--step N of --job), or with no --step a whole job (--job,
given explicitly). The commit record goes first, so that a delete cut short
leaves an uncommitted step, never a committed one with missing data; objects
that another committed step references are kept.

Without --force it refuses what a slip would cost a job its restart point:
the job's newest committed step (what --latest restores), a step not yet
committed (a save may still be writing it; prune removes those once idle for
--gc-grace), a step whose commit record is damaged, and a job that holds
committed steps or objects written in the last hour. It works on storage only: a daemon's hot tier or peers may
still hold a copy of a deleted step in memory until they evict it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			hasStep := cmd.Flags().Changed("step")
			if !hasStep && !cmd.Flags().Changed("job") {
				return usageError{fmt.Errorf("name what to delete: --step N (of --job), or --job NAME for a whole job")}
			}
			return runDelete(cmd.Context(), o, hasStep, cmd.OutOrStdout())
		},
	}
	o.storageOptions.registerInteractive(cmd.Flags())
	cmd.Flags().Int64Var(&o.Step, "step", 0, "the step to delete (without it, the whole --job)")
	cmd.Flags().BoolVar(&o.Force, "force", false, "also delete the newest committed step, an uncommitted or damaged step, or a job with committed steps or objects written in the last hour")
	cmd.Flags().BoolVar(&o.DryRun, "dry-run", false, "print what would be deleted, delete nothing")
	return cmd
}

func runDelete(ctx context.Context, o *deleteOptions, oneStep bool, out io.Writer) error {
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	opts := checkpoint.DeleteOptions{Force: o.Force, DryRun: o.DryRun}
	var rep *checkpoint.PruneReport
	what := fmt.Sprintf("job %q", o.Job)
	if oneStep {
		what = fmt.Sprintf("step %d of job %q", o.Step, o.Job)
		rep, err = store.DeleteStep(ctx, o.Step, opts)
	} else {
		rep, err = store.DeleteJob(ctx, opts)
	}
	if errors.Is(err, checkpoint.ErrNeedsForce) {
		return usageError{fmt.Errorf("%w; --force deletes it anyway", err)}
	}
	if rep != nil {
		verb := "deleted"
		if o.DryRun {
			verb = "would delete"
		}
		fmt.Fprintf(out, "%s %s: steps %v, %d objects and %d temporaries, %s\n",
			verb, what, rep.Removed, rep.Objects-len(rep.Temporaries), len(rep.Temporaries), human(rep.Bytes))
		if len(rep.Damaged) > 0 {
			fmt.Fprintf(out, "kept every object another step might reference, but the manifests of steps %v are damaged, "+
				"so what they reference is not known (see ckptd verify)\n", rep.Damaged)
		}
	}
	return err
}
