package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
)

type listOptions struct {
	storageOptions
	JSON bool
	All  bool
	Jobs bool
}

func newListCmd() *cobra.Command {
	o := &listOptions{}
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List committed steps (with --all, also every attempt's objects, committed or not)",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runList(cmd.Context(), o, cmd.OutOrStdout()) },
	}
	o.storageOptions.registerInteractive(cmd.Flags())
	cmd.Flags().BoolVar(&o.JSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&o.Jobs, "jobs", false, "list the jobs in the store instead of one job's steps")
	cmd.Flags().BoolVar(&o.All, "all", false, "also show uncommitted attempts (half-written steps, a crashed run's ranks) and damaged steps; lists every object")
	return cmd
}

// stepJSON is one line of `list --json`; scripts depend on these names.
type stepJSON struct {
	Step        int64     `json:"step"`
	WorldSize   int       `json:"world_size"`
	Bytes       int64     `json:"bytes"`
	StoredBytes int64     `json:"stored_bytes"`
	CommittedAt time.Time `json:"committed_at"`
	Attempt     string    `json:"attempt,omitempty"`
}

func runList(ctx context.Context, o *listOptions, out io.Writer) error {
	if o.Jobs {
		return listJobs(ctx, o, out)
	}
	store, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	if o.All {
		return listAll(ctx, store, o.JSON, out)
	}
	recs, err := store.Steps(ctx)
	if err != nil {
		return err
	}
	steps := make([]stepJSON, len(recs))
	for i, r := range recs {
		steps[i] = stepJSON{r.Step, r.WorldSize, r.Bytes, r.StoredBytes, r.CommittedAt, r.Attempt}
	}
	if o.JSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(steps)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tRANKS\tBYTES\tSTORED\tRATIO\tCOMMITTED\tATTEMPT")
	for _, s := range steps {
		ratio := 0.0
		if s.StoredBytes > 0 {
			ratio = float64(s.Bytes) / float64(s.StoredBytes)
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%.2f\t%s\t%s\n", s.Step, s.WorldSize, human(s.Bytes), human(s.StoredBytes),
			ratio, s.CommittedAt.Local().Format(time.DateTime), attemptLabel(s.Attempt))
	}
	return tw.Flush()
}

// attemptJSON is one line of `list --all --json`: one attempt's objects
// of one step.
type attemptJSON struct {
	Step      int64     `json:"step"`
	Attempt   string    `json:"attempt"`
	State     string    `json:"state"` // committed, uncommitted, garbage (another attempt committed the step), damaged
	Ranks     int       `json:"ranks"` // manifests present
	WorldSize int       `json:"world_size"`
	Objects   int       `json:"objects"`
	Bytes     int64     `json:"bytes"`
	Newest    time.Time `json:"newest"`
}

// listAll prints every attempt of every step, so an operator sees
// half-written steps and a crashed run's leftovers.
func listAll(ctx context.Context, store *checkpoint.Store, asJSON bool, out io.Writer) error {
	inv, err := store.Inventory(ctx)
	if err != nil {
		return err
	}
	var rows []attemptJSON
	for _, si := range inv {
		winner, committed := si.Committed()
		for _, a := range si.Attempts {
			state := "uncommitted"
			switch {
			case si.Damaged != nil:
				state = "damaged"
			case committed && a.Attempt == winner:
				state = "committed"
			case committed:
				state = "garbage"
			}
			rows = append(rows, attemptJSON{si.Step, a.Attempt, state, a.Ranks, a.WorldSize, a.Objects, a.Bytes, a.Newest.UTC()})
		}
	}
	if asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tATTEMPT\tSTATE\tRANKS\tBYTES\tLAST WRITE")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d/%d\t%s\t%s\n", r.Step, attemptLabel(r.Attempt), r.State, r.Ranks, r.WorldSize,
			human(r.Bytes), r.Newest.Local().Format(time.DateTime))
	}
	return tw.Flush()
}

func human(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// listJobs prints the jobs in the store, one per line (--json: a list).
func listJobs(ctx context.Context, o *listOptions, out io.Writer) error {
	b, err := o.open(ctx, false)
	if err != nil {
		return err
	}
	defer b.Close()
	jobs, err := checkpoint.Jobs(ctx, b)
	if err != nil {
		return err
	}
	if o.JSON {
		if jobs == nil {
			jobs = []string{}
		}
		return json.NewEncoder(out).Encode(jobs)
	}
	for _, j := range jobs {
		fmt.Fprintln(out, j)
	}
	return nil
}
