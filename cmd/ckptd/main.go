// Command ckptd is the checkpoint and data-prefetch sidecar: `ckptd serve`
// runs the daemon; restore, list, verify and prune work on storage directly.
//
// Every flag may also come from the environment (CKPTD_<FLAG>, e.g.
// CKPTD_STAGING_BYTES) or from a YAML config file (--config, keys named as
// the flags, with dashes; a key that names no flag of any command is a
// usage error); the command line wins, then the environment, then the file.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/ckptd/ckptd/internal/daemon"
	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "ckptd:", err)
		os.Exit(exitCode(err))
	}
}

// exitCode is 1 for failures and 2 for usage errors (the daemon's
// settings it cannot start with too).
func exitCode(err error) int {
	var ue usageError
	if errors.As(err, &ue) || errors.As(err, new(daemon.UsageError)) {
		return 2
	}
	return 1
}

type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "ckptd",
		Short:         "Asynchronous checkpointing and data prefetching sidecar for GPU training",
		Version:       Version(),
		SilenceUsage:  true,
		SilenceErrors: true,
		// A mistyped subcommand is bad usage (exit 2), like a bad flag.
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usageError{unknownCommand(cmd, args[0])}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyConfig(cmd); err != nil {
				return usageError{err}
			}
			return setupLogging(cmd)
		},
	}
	root.PersistentFlags().String("config", "", "YAML file of flag values (env CKPTD_CONFIG)")
	root.PersistentFlags().String("log-level", "info", "debug, info, warn or error")
	root.PersistentFlags().String("log-format", "text", "text, or json (one object per line; keys job, step, rank, attempt, bytes, duration in seconds)")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.SetUsageFunc(groupedUsage) // every command's flags wrapped to helpColumns, serve's under groups
	root.AddCommand(newServeCmd(), newRestoreCmd(), newListCmd(), newVerifyCmd(), newPruneCmd(), newDeleteCmd(), newCleanupCmd(), newHealthCmd(),
		newStatusCmd(), newExportCmd())
	return root
}

// unknownCommand names the commands there are, from the command tree, so
// that the message stays true as commands are added.
func unknownCommand(root *cobra.Command, name string) error {
	var names []string
	for _, c := range root.Commands() {
		if c.IsAvailableCommand() {
			names = append(names, c.Name())
		}
	}
	msg := fmt.Sprintf("unknown command %q", name)
	if root.SuggestionsMinimumDistance <= 0 {
		root.SuggestionsMinimumDistance = 2 // cobra's default, set only on its own unknown-command path
	}
	if s := root.SuggestionsFor(name); len(s) > 0 {
		msg += fmt.Sprintf(" (did you mean %s?)", strings.Join(s, " or "))
	}
	if n := len(names); n > 1 {
		msg += fmt.Sprintf("; the commands are %s and %s", strings.Join(names[:n-1], ", "), names[n-1])
	}
	return fmt.Errorf("%s (see ckptd --help)", msg)
}
