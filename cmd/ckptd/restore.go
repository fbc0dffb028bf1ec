package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/safetensors"
)

type restoreOptions struct {
	storageOptions
	stepChoice
	Out         string
	Rank        int
	Concurrency int
	Progress    bool
}

func newRestoreCmd() *cobra.Command {
	o := &restoreOptions{}
	cmd := &cobra.Command{
		Use:   "restore (--step N | --latest [--finite]) --out DIR [--rank R]",
		Short: "Write a committed step as rank-<rank>.safetensors files plus metadata.json",
		Long: `Restore reads a committed step straight from storage (no daemon needed),
verifies every chunk against its hash, and writes one rank-NNNNN.safetensors
file per rank (or only --rank R) and metadata.json into --out. Files appear
only once every chunk has been verified: a corrupt checkpoint leaves nothing
in --out that looks valid.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Progress = term.IsTerminal(int(os.Stderr.Fd()))
			if err := o.stepChoice.check(cmd.Flags()); err != nil {
				return err
			}
			if o.Out == "" {
				return usageError{errors.New("--out DIR is required")}
			}
			return runRestore(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	o.storageOptions.registerInteractive(fs)
	o.stepChoice.register(fs, "restore")
	fs.StringVar(&o.Out, "out", "", "folder to write into (created if missing)")
	fs.IntVar(&o.Rank, "rank", -1, "restore only this rank")
	fs.IntVar(&o.Concurrency, "concurrency", 8, "chunks fetched at once")
	return cmd
}

// rankMeta is one rank's entry in metadata.json.
type rankMeta struct {
	Rank     int    `json:"rank"`
	File     string `json:"file"`
	Tensors  int    `json:"tensors"`
	Bytes    int64  `json:"bytes"`
	Metadata []byte `json:"metadata"` // the trainer's bytes, base64
}

type stepMeta struct {
	Job         string     `json:"job"`
	Step        int64      `json:"step"`
	Attempt     string     `json:"attempt,omitempty"`
	WorldSize   int        `json:"world_size"`
	CommittedAt time.Time  `json:"committed_at"`
	Ranks       []rankMeta `json:"ranks"`
}

func runRestore(ctx context.Context, o *restoreOptions, stdout io.Writer) error {
	store, rec, closeStore, err := o.openStep(ctx, o.stepChoice, o.Rank < 0, os.Stderr)
	if err != nil {
		return err
	}
	defer closeStore()
	ranks, err := ranksToRestore(rec, o.Rank)
	if err != nil {
		return err
	}
	manifests := make([]*checkpoint.Manifest, len(ranks))
	var total int64
	for i, r := range ranks {
		if manifests[i], err = store.Manifest(ctx, rec, r); err != nil {
			return err
		}
		total += manifests[i].DataSize
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return err
	}
	w := &restoreWriter{store: store, out: o.Out, opts: checkpoint.ReadOptions{Concurrency: o.Concurrency}}
	defer w.cleanup()
	if o.Progress {
		bar := progressbar.DefaultBytes(total, fmt.Sprintf("restoring step %d", rec.Step))
		w.opts.Progress = func(n int64) { _ = bar.Add64(n) }
		defer bar.Finish()
	}
	meta := stepMeta{Job: rec.Job, Step: rec.Step, Attempt: rec.Attempt, WorldSize: rec.WorldSize, CommittedAt: rec.CommittedAt}
	for _, m := range manifests {
		rm, err := w.writeRank(ctx, m)
		if err != nil {
			return err
		}
		meta.Ranks = append(meta.Ranks, rm)
	}
	if err := w.writeMetadata(meta); err != nil {
		return err
	}
	if err := w.publish(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "restored step %d (%d of %d ranks, %d bytes) to %s\n", rec.Step, len(ranks), rec.WorldSize, total, o.Out)
	return nil
}

func ranksToRestore(rec *checkpoint.CommitRecord, rank int) ([]int, error) {
	if rank >= rec.WorldSize || rank < -1 {
		return nil, usageError{fmt.Errorf("--rank %d out of range: step %d has world size %d", rank, rec.Step, rec.WorldSize)}
	}
	if rank >= 0 {
		return []int{rank}, nil
	}
	all := make([]int, rec.WorldSize)
	for i := range all {
		all[i] = i
	}
	return all, nil
}

// restoreWriter writes files under temporary names and renames them into
// place only when every rank has been verified.
type restoreWriter struct {
	store  *checkpoint.Store
	out    string
	opts   checkpoint.ReadOptions
	temps  []string // temp files, renamed by publish to finals
	finals []string
}

func (w *restoreWriter) create(name string) (*os.File, error) {
	f, err := os.CreateTemp(w.out, "."+name+".tmp-*")
	if err != nil {
		return nil, err
	}
	w.temps = append(w.temps, f.Name())
	w.finals = append(w.finals, filepath.Join(w.out, name))
	return f, nil
}

// writeRank writes one rank's safetensors file: header, then the shard's
// data space, which is exactly a safetensors data section.
func (w *restoreWriter) writeRank(ctx context.Context, m *checkpoint.Manifest) (rankMeta, error) {
	name := fmt.Sprintf("rank-%05d.safetensors", m.Rank)
	header, err := safetensors.EncodeHeader(safetensors.ForFile(toSafetensors(m.Tensors), nil))
	if err != nil {
		return rankMeta{}, fmt.Errorf("step %d rank %d: %w", m.Step, m.Rank, err)
	}
	f, err := w.create(name)
	if err != nil {
		return rankMeta{}, err
	}
	defer f.Close()
	if _, err := f.Write(header); err != nil {
		return rankMeta{}, err
	}
	sink := &offsetWriter{f: f, base: int64(len(header))}
	if err := w.store.ReadShard(ctx, m, sink, w.opts); err != nil {
		return rankMeta{}, err
	}
	if err := f.Truncate(int64(len(header)) + m.DataSize); err != nil {
		return rankMeta{}, err
	}
	if err := f.Sync(); err != nil {
		return rankMeta{}, err
	}
	return rankMeta{Rank: m.Rank, File: name, Tensors: len(userTensors(m.Tensors)), Bytes: m.DataSize, Metadata: m.Metadata}, f.Close()
}

func (w *restoreWriter) writeMetadata(meta stepMeta) error {
	b, err := json.MarshalIndent(meta, "", " ")
	if err != nil {
		return err
	}
	f, err := w.create("metadata.json")
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(append(b, '\n')); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}

// publish renames every temp file to its final name.
func (w *restoreWriter) publish() error {
	for i, tmp := range w.temps {
		if err := os.Rename(tmp, w.finals[i]); err != nil {
			return err
		}
	}
	w.temps = nil
	return syncDir(w.out)
}

func (w *restoreWriter) cleanup() {
	for _, tmp := range w.temps {
		_ = os.Remove(tmp)
	}
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// offsetWriter shifts writes past the safetensors header.
type offsetWriter struct {
	f    *os.File
	base int64
}

func (w *offsetWriter) WriteAt(p []byte, off int64) (int, error) { return w.f.WriteAt(p, w.base+off) }

func toSafetensors(ts []checkpoint.Tensor) []safetensors.Tensor {
	ts = userTensors(ts)
	out := make([]safetensors.Tensor, len(ts))
	for i, t := range ts {
		out[i] = safetensors.Tensor{Name: t.Name, DType: t.DType, Shape: t.Shape, Begin: t.Offset, End: t.Offset + t.Length}
	}
	return out
}

// kindsRecord begins the names of the empty tensors in which the Python
// client records which values of a save were torch tensors (so that its
// load gives them back as such): not the trainer's state, and holding no
// bytes, they are left out of the files restore writes.
const kindsRecord = "ckptd.as:"

// userTensors is ts without the Python client's empty kind records.
func userTensors(ts []checkpoint.Tensor) []checkpoint.Tensor {
	out := make([]checkpoint.Tensor, 0, len(ts))
	for _, t := range ts {
		if t.Length != 0 || !strings.HasPrefix(t.Name, kindsRecord) {
			out = append(out, t)
		}
	}
	return out
}
