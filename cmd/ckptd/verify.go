package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
)

type verifyOptions struct {
	storageOptions
	Step        int64
	Latest      bool
	Concurrency int
}

func newVerifyCmd() *cobra.Command {
	o := &verifyOptions{}
	cmd := &cobra.Command{
		Use:   "verify (--step N | --latest)",
		Short: "Read every chunk of a committed step and check it against its hash",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("step") == o.Latest {
				return usageError{errors.New("give exactly one of --step N and --latest")}
			}
			return runVerify(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	o.storageOptions.registerInteractive(cmd.Flags())
	cmd.Flags().Int64Var(&o.Step, "step", 0, "step to verify")
	cmd.Flags().BoolVar(&o.Latest, "latest", false, "verify the newest committed step")
	cmd.Flags().IntVar(&o.Concurrency, "concurrency", 8, "chunks fetched at once")
	return cmd
}

func runVerify(ctx context.Context, o *verifyOptions, out io.Writer) error {
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	rep, err := store.Verify(ctx, o.Step, o.Latest, checkpoint.ReadOptions{Concurrency: o.Concurrency})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "step %d OK: %d ranks, %d chunks, %s verified\n", rep.Step, rep.WorldSize, rep.Chunks, human(rep.Bytes))
	return nil
}
