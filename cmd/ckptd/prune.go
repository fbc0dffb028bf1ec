package main

import (
	"context"
	"fmt"
	"io"

	"github.com/spf13/cobra"
)

type pruneOptions struct {
	storageOptions
	KeepLast int
	DryRun   bool
}

func newPruneCmd() *cobra.Command {
	o := &pruneOptions{}
	cmd := &cobra.Command{
		Use:   "prune --keep-last N [--dry-run]",
		Short: "Delete all but the newest N committed steps (and older incomplete ones)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("keep-last") {
				return usageError{fmt.Errorf("--keep-last N is required")}
			}
			return runPrune(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	o.storageOptions.register(cmd.Flags())
	cmd.Flags().IntVar(&o.KeepLast, "keep-last", 0, "committed steps to keep")
	cmd.Flags().BoolVar(&o.DryRun, "dry-run", false, "print what would be deleted, delete nothing")
	return cmd
}

func runPrune(ctx context.Context, o *pruneOptions, out io.Writer) error {
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	rep, err := store.Prune(ctx, o.KeepLast, o.DryRun)
	if err != nil {
		return err
	}
	verb := "removed"
	if o.DryRun {
		verb = "would remove"
	}
	fmt.Fprintf(out, "kept steps %v\n%s steps %v and incomplete steps %v: %d objects, %s\n",
		rep.Kept, verb, rep.Removed, rep.Partial, rep.Objects, human(rep.Bytes))
	return nil
}
