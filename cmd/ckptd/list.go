package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
)

type listOptions struct {
	storageOptions
	JSON   bool
	All    bool
	Jobs   bool
	Tiers  bool
	Socket string
}

func newListCmd() *cobra.Command {
	o := &listOptions{}
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List committed steps (with --all, also every attempt's objects, committed or not)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.Tiers && !cmd.Flags().Changed("job") {
				o.Job = "" // the daemon's own default job
			}
			return runList(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	o.storageOptions.registerInteractive(cmd.Flags())
	cmd.Flags().BoolVar(&o.JSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&o.Jobs, "jobs", false, "list the jobs in the store instead of one job's steps")
	cmd.Flags().BoolVar(&o.All, "all", false, "also show uncommitted attempts (half-written steps, a crashed run's ranks) and damaged steps; lists every object")
	cmd.Flags().BoolVar(&o.Tiers, "tiers", false, "ask the daemon on --socket: also the steps kept in memory only (serve --persist-every), and where each step can be restored from (storage, hot, peers)")
	cmd.Flags().StringVar(&o.Socket, "socket", "", "the daemon's socket, for --tiers (default as for serve)")
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
	// NonFinite counts the step's NaN and infinite values, in
	// NonFiniteTensors tensors: a run that diverged.
	NonFinite        int64 `json:"nonfinite,omitempty"`
	NonFiniteTensors int   `json:"nonfinite_tensors,omitempty"`
}

func runList(ctx context.Context, o *listOptions, out io.Writer) error {
	if o.Jobs {
		return listJobs(ctx, o, out)
	}
	if o.Tiers {
		return listTiers(ctx, o, out)
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
		steps[i] = stepJSON{r.Step, r.WorldSize, r.Bytes, r.StoredBytes, r.CommittedAt, r.Attempt, r.NonFinite, r.NonFiniteTensors}
	}
	if o.JSON {
		return writeJSON(out, steps)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tRANKS\tBYTES\tSTORED\tRATIO\tCOMMITTED\tATTEMPT\tNAN/INF")
	for _, s := range steps {
		ratio := 0.0
		if s.StoredBytes > 0 {
			ratio = float64(s.Bytes) / float64(s.StoredBytes)
		}
		health := "none"
		if s.NonFinite > 0 {
			health = fmt.Sprintf("%d in %d tensors", s.NonFinite, s.NonFiniteTensors)
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%.2f\t%s\t%s\t%s\n", s.Step, s.WorldSize, human(s.Bytes), human(s.StoredBytes),
			ratio, s.CommittedAt.Local().Format(time.DateTime), attemptLabel(s.Attempt), health)
	}
	return tw.Flush()
}

// attemptJSON is one line of `list --all --json`: one attempt's objects
// of one step.
type attemptJSON struct {
	Step      int64     `json:"step"`
	Attempt   string    `json:"attempt"`
	State     string    `json:"state"` // committed, uncommitted, garbage (another attempt committed the step), damaged, temporary
	Ranks     int       `json:"ranks"` // manifests present
	WorldSize int       `json:"world_size"`
	Objects   int       `json:"objects"`
	Bytes     int64     `json:"bytes"`
	Newest    time.Time `json:"newest"`
	// Object is what a temporary would become (state "temporary" only).
	Object string `json:"object,omitempty"`
}

// listAll prints every attempt of every step, so an operator sees
// half-written steps and a crashed run's leftovers, then each temporary:
// a write in progress, or what a writer killed mid-write left (prune
// removes those idle for --gc-grace).
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
			rows = append(rows, attemptJSON{si.Step, a.Attempt, state, a.Ranks, a.WorldSize, a.Objects, a.Bytes, a.Newest.UTC(), ""})
		}
	}
	temps, err := store.Temporaries(ctx)
	if err != nil {
		return err
	}
	for _, t := range temps {
		rows = append(rows, attemptJSON{Step: t.Step, Attempt: t.Attempt, State: "temporary", Objects: 1, Bytes: t.Size,
			Newest: t.ModTime.UTC(), Object: t.Name})
	}
	if asJSON {
		return writeJSON(out, rows)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tATTEMPT\tSTATE\tRANKS\tBYTES\tLAST WRITE\tOBJECT")
	for _, r := range rows {
		ranks := fmt.Sprintf("%d/%d", r.Ranks, r.WorldSize)
		if r.State == "temporary" {
			ranks = "-"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Step, attemptLabel(r.Attempt), r.State, ranks,
			human(r.Bytes), r.Newest.Local().Format(time.DateTime), r.Object)
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

// tierJSON is one line of `list --tiers --json`.
type tierJSON struct {
	Step       int64    `json:"step"`
	WorldSize  int      `json:"world_size"`
	Attempt    string   `json:"attempt,omitempty"`
	Tiers      []string `json:"tiers"`
	MemoryOnly bool     `json:"memory_only"`
	RanksHeld  int      `json:"ranks_held,omitempty"`
}

// tiersTimeout bounds `list --tiers`: the daemon lists storage and asks
// its peers (each for a few seconds at most).
const tiersTimeout = 30 * time.Second

// listTiers asks the daemon which steps it, its peers and storage can
// restore.
func listTiers(ctx context.Context, o *listOptions, out io.Writer) error {
	c, _, err := dialDaemon(o.Socket)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, tiersTimeout)
	defer cancel()
	steps, err := c.Tiers(ctx, o.Job)
	if err != nil {
		return err
	}
	rows := make([]tierJSON, len(steps))
	for i, s := range steps {
		rows[i] = tierJSON{s.Step, s.WorldSize, s.Attempt, s.Tiers, s.MemoryOnly, s.RanksHeld}
	}
	if o.JSON {
		return writeJSON(out, rows)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "STEP\tRANKS\tATTEMPT\tTIERS\tNOTE")
	for _, r := range rows {
		note := ""
		switch {
		case r.MemoryOnly && r.RanksHeld < r.WorldSize:
			note = fmt.Sprintf("memory only, %d/%d ranks held: not restorable", r.RanksHeld, r.WorldSize)
		case r.MemoryOnly:
			note = "memory only"
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\n", r.Step, r.WorldSize, attemptLabel(r.Attempt), strings.Join(r.Tiers, ","), note)
	}
	return tw.Flush()
}

// writeJSON prints v indented, as the --json outputs are.
func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
