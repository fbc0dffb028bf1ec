package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

type statusOptions struct {
	Socket  string
	JSON    bool
	Watch   time.Duration
	Timeout time.Duration
}

func newStatusCmd() *cobra.Command {
	o := &statusOptions{}
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show what the daemon on the socket is doing: arena use, saves and their states, leases and their owners, dataset sessions, errors by operation and by backend",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runStatus(cmd.Context(), o, cmd.OutOrStdout()) },
	}
	fs := cmd.Flags()
	fs.StringVar(&o.Socket, "socket", "", "the daemon's socket (default as for serve)")
	fs.BoolVar(&o.JSON, "json", false, "print the status as JSON (the protocol's DaemonStatus message; 64-bit integers as numbers)")
	fs.DurationVar(&o.Watch, "watch", 0, "redraw every interval (e.g. 2s) until interrupted")
	fs.DurationVar(&o.Timeout, "timeout", 5*time.Second, "how long to wait for each answer")
	return cmd
}

func runStatus(ctx context.Context, o *statusOptions, out io.Writer) error {
	if o.Watch < 0 {
		return usageError{fmt.Errorf("--watch must be positive, got %s", o.Watch)}
	}
	c, socket, err := dialDaemon(o.Socket)
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		cctx, cancel := context.WithTimeout(ctx, o.Timeout)
		st, err := c.Status(cctx)
		cancel()
		if err != nil {
			return err
		}
		if o.Watch > 0 {
			redraw(out, o.JSON)
		}
		if err := printStatus(out, socket, st, o.JSON); err != nil {
			return err
		}
		if o.Watch == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil // interrupted: the way to end --watch
		case <-time.After(o.Watch):
		}
	}
}

// redraw starts a frame of --watch: on a terminal, a table is drawn over
// the last one (home, clear); into a pipe or a file, or as JSON, frames
// follow each other with no escape codes (a JSON frame is one object).
func redraw(out io.Writer, asJSON bool) {
	if f, ok := out.(*os.File); ok && !asJSON && term.IsTerminal(int(f.Fd())) {
		fmt.Fprint(out, "\033[H\033[2J")
		return
	}
	if !asJSON {
		fmt.Fprintf(out, "--- %s\n", time.Now().Format(time.RFC3339))
	}
}

func printStatus(out io.Writer, socket string, st *pb.DaemonStatus, asJSON bool) error {
	if asJSON {
		b, err := protoJSON(st.ProtoReflect())
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(out, "%s\n", b)
		return err
	}
	w := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	printSummary(w, socket, st)
	printSaves(w, st.GetSaves())
	printLeases(w, st.GetLeases())
	printDatasets(w, st.GetDatasets())
	return w.Flush()
}

func printSummary(w io.Writer, socket string, st *pb.DaemonStatus) {
	fmt.Fprintf(w, "ckptd %s at %s, up %s, default job %q\n", st.GetVersion(), socket,
		seconds(st.GetUptimeSeconds()), st.GetDefaultJob())
	ready := "ready"
	if !st.GetStorageReady() {
		ready = "NOT READY: " + st.GetStorageError()
	}
	fmt.Fprintf(w, "storage\t%s\t%s\n", st.GetStorage(), ready)
	a := st.GetArena()
	fmt.Fprintf(w, "arena\t%s of %s used\tstaging %s, restores %s, datasets %s (of %s), held for gone clients %s\n",
		human(int64(a.GetUsed())), human(int64(a.GetSize())), human(int64(a.GetStaging())), human(int64(a.GetRestores())),
		human(int64(a.GetDatasets())), human(int64(a.GetDatasetsShare())), human(int64(a.GetHeld())))
	if h := st.GetHot(); h.GetBudget() > 0 {
		fmt.Fprintf(w, "hot tier\t%s of %s\t%d rank shards\n", human(int64(h.GetBytes())), human(int64(h.GetBudget())), h.GetShards())
	} else {
		fmt.Fprintf(w, "hot tier\toff (--hot-bytes)\n")
	}
	fmt.Fprintf(w, "errors\t%s\n", cmp.Or(formatCounts(st.GetErrors()), "none"))
	backend := "none counted (a daemon older than this command)"
	if len(st.GetBackendErrors()) > 0 {
		backend = formatCounts(st.GetBackendErrors(), "store", "dataset", "peers")
	}
	fmt.Fprintf(w, "backend errors\t%s\n", backend)
}

// formatCounts lists counts as "name n, ...": the names in first, in that
// order, then the others sorted; "" when there are none.
func formatCounts(counts map[string]uint64, first ...string) string {
	var parts []string
	for _, n := range first {
		if v, ok := counts[n]; ok {
			parts = append(parts, fmt.Sprintf("%s %d", n, v))
		}
	}
	for _, n := range slices.Sorted(maps.Keys(counts)) {
		if !slices.Contains(first, n) {
			parts = append(parts, fmt.Sprintf("%s %d", n, counts[n]))
		}
	}
	return strings.Join(parts, ", ")
}

func printSaves(w io.Writer, saves []*pb.SaveActivity) {
	fmt.Fprintf(w, "\nSAVES (%d)\n", len(saves))
	if len(saves) == 0 {
		return
	}
	fmt.Fprintln(w, "JOB\tSTEP\tRANK\tATTEMPT\tSTATE\tFOR\tAGE\tERROR")
	for _, s := range saves {
		t := s.GetTarget()
		fmt.Fprintf(w, "%s\t%d\t%d/%d\t%s\t%s\t%s\t%s\t%s\n", t.GetJob(), t.GetStep(), t.GetRank(), t.GetWorldSize(),
			t.GetAttempt(), s.GetState(), seconds(s.GetSecondsInState()), seconds(s.GetAgeSeconds()), oneLine(s.GetError()))
	}
}

func printLeases(w io.Writer, leases []*pb.LeaseState) {
	fmt.Fprintf(w, "\nLEASES (%d)\n", len(leases))
	if len(leases) == 0 {
		return
	}
	fmt.Fprintln(w, "ID\tKIND\tPEER\tBYTES\tAGE\tEXPIRES IN\tSAVE")
	for _, l := range leases {
		expires, save := "-", "-"
		if l.GetJournaled() {
			expires = "journaled"
		} else if l.GetExpiresInSeconds() > 0 {
			expires = seconds(l.GetExpiresInSeconds())
		}
		if t := l.GetTarget(); t != nil {
			save = fmt.Sprintf("%s step %d rank %d", t.GetJob(), t.GetStep(), t.GetRank())
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", l.GetIdPrefix(), l.GetKind(), orDash(l.GetPeer()),
			human(int64(l.GetBytes())), seconds(l.GetAgeSeconds()), expires, save)
	}
}

func printDatasets(w io.Writer, ds []*pb.DatasetState) {
	fmt.Fprintf(w, "\nDATASETS (%d)\n", len(ds))
	if len(ds) == 0 {
		return
	}
	fmt.Fprintln(w, "PEER\tSOURCE\tRANK\tEPOCH\tIDLE\tCACHE HITS/MISSES\tRING SLOTS\tREAD AHEAD")
	for _, d := range ds {
		fmt.Fprintf(w, "%s\t%s\t%d/%d\t%d\t%s\t%d/%d\t%d of %d\t%s of %s\n", orDash(d.GetPeer()), d.GetSource(), d.GetRank(), d.GetWorldSize(),
			d.GetEpoch(), seconds(d.GetIdleSeconds()), d.GetStats().GetCacheHits(), d.GetStats().GetCacheMisses(),
			d.GetRingSlots(), d.GetRingSlotsMax(), human(d.GetReadAheadBytes()), human(d.GetReadAheadTarget()))
	}
}

// seconds prints a duration in seconds the way people read it.
func seconds(s float64) string {
	d := time.Duration(s * float64(time.Second))
	if d >= time.Minute {
		return d.Round(time.Second).String()
	}
	return d.Round(100 * time.Millisecond).String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine keeps a table row on one line.
func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }
