package main

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/daemon"
)

type cleanupOptions struct {
	Force  bool
	DryRun bool
}

func newCleanupCmd() *cobra.Command {
	o := &cleanupOptions{}
	cmd := &cobra.Command{
		Use:   "cleanup [--dry-run] [--force]",
		Short: "Remove the shared-memory arenas your daemons left when they died",
		Long: `Remove the staging arenas in /dev/shm of this user's daemons that are gone
(killed, crashed, their node drained), giving their memory back. Every start
of ckptd serve does the same; this does it on demand. An arena whose journal
holds staged saves (acknowledged to a trainer, not yet in storage) is kept
and named with its socket: a daemon started on that socket drains it.
--force removes it too, and those saves are lost. Only default arena folders
are looked at, never an explicit --arena-dir, and never one a daemon holds.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runCleanup(o, cmd.OutOrStdout())
		},
	}
	cmd.Flags().BoolVar(&o.Force, "force", false, "also remove arenas holding staged saves, which are lost")
	cmd.Flags().BoolVar(&o.DryRun, "dry-run", false, "print what would be removed, remove nothing")
	return cmd
}

func runCleanup(o *cleanupOptions, out io.Writer) error {
	reaped, err := arena.ReapStale(arena.ReapOptions{Parent: daemon.ShmDir(), Names: daemon.StaleArenaNames(),
		Force: o.Force, DryRun: o.DryRun})
	if len(reaped) == 0 {
		fmt.Fprintln(out, "no arena of a dead daemon of yours")
		return err
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ARENA\tSOCKET\tSTAGED SAVES\tMEMORY\tDONE")
	for _, st := range reaped {
		done := "removed"
		switch {
		case o.DryRun && (st.Journaled == 0 || o.Force):
			done = "would remove"
		case !st.Removed:
			done = "kept: start ckptd serve on its socket to drain it, or --force"
		}
		socket := st.Socket
		if socket == "" {
			socket = "(not recorded)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", st.Dir, socket, st.Journaled, human(st.Bytes), done)
	}
	if ferr := tw.Flush(); err == nil {
		err = ferr
	}
	return err
}
