package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// printResults prints one backend's tables: requests per rank per step
// and the commit's times against the rank count, then the commands'.
func printResults(w io.Writer, backend string, cfg config, rs []*result) {
	s3 := backend == "s3"
	fmt.Fprintln(w)
	if s3 {
		fmt.Fprintf(w, "S3 (MinIO, counted at a proxy in front of it%s): per rank per step, median of %d steps\n", throttled(cfg), cfg.steps)
	} else {
		fmt.Fprintf(w, "POSIX folder: per step, median of %d steps (no request counts: see the package comment)\n", cfg.steps)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	cols := []string{"ranks"}
	if s3 {
		cols = append(cols, kinds...)
		cols = append(cols, "total", "GET commit", "GET manifest", "503")
	}
	cols = append(cols, "manifest→COMMIT", "save→COMMIT", "save→all waits", "RSS/daemon", "fds/daemon")
	fmt.Fprintln(tw, strings.Join(cols, "\t")+"\t")
	var first, last []float64
	for i, r := range rs {
		n := float64(r.ranks)
		var vals []float64
		var cells []string
		if s3 {
			for _, k := range kinds {
				vals = append(vals, medianOf(r.steps, func(s stepResult) float64 { return float64(s.counts[k]) / n }))
			}
			vals = append(vals,
				medianOf(r.steps, func(s stepResult) float64 { return float64(s.counts.total()) / n }),
				medianOf(r.steps, func(s stepResult) float64 { return float64(s.counts[kindGet+":"+objCommit]) / n }),
				medianOf(r.steps, func(s stepResult) float64 { return float64(s.counts[kindGet+":"+objManifest]) / n }),
				medianOf(r.steps, func(s stepResult) float64 { return float64(s.counts["503"]) / n }))
			for _, v := range vals {
				cells = append(cells, fmt.Sprintf("%.2f", v))
			}
		}
		times := []float64{
			medianOf(r.steps, func(s stepResult) float64 { return ms(s.commit.Sub(s.lastManifest)) }),
			medianOf(r.steps, func(s stepResult) float64 { return ms(s.commit.Sub(s.lastSave)) }),
			medianOf(r.steps, func(s stepResult) float64 { return ms(s.allWaits.Sub(s.lastSave)) }),
		}
		for _, t := range times {
			cells = append(cells, fmt.Sprintf("%.0f ms", t))
		}
		vals = append(vals, times...)
		d := float64(cfg.daemons)
		cells = append(cells, fmt.Sprintf("%.0f MiB", float64(r.rss)/d/(1<<20)), fmt.Sprintf("%.0f", float64(r.fds)/d))
		vals = append(vals, float64(r.rss)/d, float64(r.fds)/d)
		fmt.Fprintf(tw, "%d\t%s\t\n", r.ranks, strings.Join(cells, "\t"))
		if i == 0 {
			first = vals
		}
		last = vals
	}
	if len(rs) > 1 {
		var cells []string
		for i := range last {
			cells = append(cells, ratio(last[i], first[i]))
		}
		fmt.Fprintf(tw, "%d/%d\t%s\t\n", rs[len(rs)-1].ranks, rs[0].ranks, strings.Join(cells, "\t"))
	}
	tw.Flush()

	fmt.Fprintln(w)
	if s3 {
		fmt.Fprintln(w, "Commands on the job after its steps (requests in all, and per rank of the step; time):")
	} else {
		fmt.Fprintln(w, "Commands on the job after its steps (time):")
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	hdr := []string{"ranks"}
	for _, c := range rs[0].cli {
		hdr = append(hdr, c.name)
	}
	fmt.Fprintln(tw, strings.Join(hdr, "\t")+"\t")
	for _, r := range rs {
		cells := []string{fmt.Sprint(r.ranks)}
		for _, c := range r.cli {
			if s3 {
				cells = append(cells, fmt.Sprintf("%d req (%.2f/rank) %s", c.counts.total(), float64(c.counts.total())/float64(r.ranks), dur(c.took)))
			} else {
				cells = append(cells, dur(c.took))
			}
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	tw.Flush()
	if s3 {
		fmt.Fprintln(w, "Requests by kind, per command, at the largest rank count:")
		for _, c := range rs[len(rs)-1].cli {
			fmt.Fprintf(w, "  %-28s %s\n", c.name, byKind(c.counts))
		}
	}
}

func throttled(cfg config) string {
	if cfg.throttle > 0 {
		return fmt.Sprintf(", throttled to %.0f requests/s per prefix", cfg.throttle)
	}
	return ""
}

func byKind(c counts) string {
	var parts []string
	for _, k := range append(kinds, kindOther, "503") {
		if c[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", k, c[k]))
		}
	}
	for k, v := range c {
		if strings.HasPrefix(k, "gone: ") || strings.HasPrefix(k, "error: ") {
			parts = append(parts, fmt.Sprintf("%s %d", k, v))
		}
	}
	return strings.Join(parts, ", ")
}

func medianOf(steps []stepResult, f func(stepResult) float64) float64 {
	vs := make([]float64, len(steps))
	for i, s := range steps {
		vs[i] = f(s)
	}
	slices.Sort(vs)
	if len(vs) == 0 {
		return 0
	}
	if len(vs)%2 == 1 {
		return vs[len(vs)/2]
	}
	return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func dur(d time.Duration) string {
	if d < 10*time.Second {
		return fmt.Sprintf("%.0f ms", ms(d))
	}
	return fmt.Sprintf("%.1f s", d.Seconds())
}

func ratio(a, b float64) string {
	if b == 0 {
		if a == 0 {
			return "-"
		}
		return "∞"
	}
	return fmt.Sprintf("×%.2f", a/b)
}
