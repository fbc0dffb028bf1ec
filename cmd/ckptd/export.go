package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/safetensors"
)

type exportOptions struct {
	storageOptions
	Step          int64
	Latest        bool
	Out           string
	Format        string
	MaxShardSize  byteSize
	WithOptimizer bool
}

func newExportCmd() *cobra.Command {
	o := &exportOptions{MaxShardSize: 5_000_000_000}
	cmd := &cobra.Command{
		Use:   "export (--step N | --latest) --out DIR [--format safetensors]",
		Short: "Write a committed step as one consolidated model folder (Hugging Face style safetensors)",
		Long: `Export reads a committed step straight from storage (no daemon needed) and
writes its model as full tensors under their state_dict names: the pieces of
sharded tensors (FSDP, DTensor, ckptd.dcp) are put back together, and the
"model:" prefix of ckptd.torch names is dropped. The files are
model.safetensors, or model-00001-of-0000N.safetensors files of at most
--max-shard-size with a model.safetensors.index.json, as Hugging Face
tooling expects; the step, job and attempt are in each file's metadata.
Optimizer state is left out unless --with-optimizer (its tensors are then
named optimizer.<name>). Every chunk is verified; files appear only once
all are written.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case cmd.Flags().Changed("step") == o.Latest:
				return usageError{errors.New("give exactly one of --step N and --latest")}
			case o.Out == "":
				return usageError{errors.New("--out DIR is required")}
			case o.Format != "safetensors":
				return usageError{fmt.Errorf("--format %q: only safetensors is supported", o.Format)}
			case o.MaxShardSize <= 0:
				return usageError{fmt.Errorf("--max-shard-size must be positive, got %d", o.MaxShardSize)}
			}
			return runExport(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	fs := cmd.Flags()
	o.storageOptions.registerInteractive(fs)
	fs.Int64Var(&o.Step, "step", 0, "step to export")
	fs.BoolVar(&o.Latest, "latest", false, "export the newest committed step")
	fs.StringVar(&o.Out, "out", "", "folder to write into (created if missing)")
	fs.StringVar(&o.Format, "format", "safetensors", "output format (safetensors)")
	fs.Var(&o.MaxShardSize, "max-shard-size", "largest file to write (default 5GB); a larger tensor gets a file of its own")
	fs.BoolVar(&o.WithOptimizer, "with-optimizer", false, "also export the optimizer's tensors, named optimizer.<name>")
	return cmd
}

func runExport(ctx context.Context, o *exportOptions, stdout io.Writer) error {
	store, rec, closeStore, err := o.openStep(ctx, o.Step, o.Latest)
	if err != nil {
		return err
	}
	defer closeStore()
	ms := make([]*checkpoint.Manifest, rec.WorldSize)
	for r := range ms {
		if ms[r], err = store.Manifest(ctx, rec, r); err != nil {
			return err
		}
	}
	tensors, err := planExport(ctx, store, ms, exportGroups(o.WithOptimizer))
	if err != nil {
		return err
	}
	if len(tensors) == 0 {
		return fmt.Errorf("step %d: %w to export (names model:<name>, or pieces described in %s)", rec.Step, errNoTensors, shardingTensor)
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return err
	}
	w := &restoreWriter{store: store, out: o.Out}
	defer w.cleanup()
	files := splitFiles(tensors, int64(o.MaxShardSize))
	meta := map[string]string{"format": "pt", "ckptd.job": rec.Job, "ckptd.step": strconv.FormatInt(rec.Step, 10), "ckptd.attempt": rec.Attempt}
	var total int64
	for i, f := range files {
		name := fileName(i, len(files))
		n, err := w.writeFull(ctx, name, f, meta)
		if err != nil {
			return err
		}
		total += n
	}
	if len(files) > 1 {
		if err := w.writeIndex(files, total); err != nil {
			return err
		}
	}
	if err := w.writeHFConfig(ctx, ms[0]); err != nil {
		return err
	}
	if err := w.publish(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "exported step %d (%d tensors, %d bytes, %d file(s)) to %s\n", rec.Step, len(tensors), total, len(files), o.Out)
	return nil
}

// splitFiles cuts tensors, in order, into files of at most max bytes; a
// larger tensor gets a file of its own.
func splitFiles(tensors []*fullTensor, max int64) [][]*fullTensor {
	var files [][]*fullTensor
	var cur []*fullTensor
	var size int64
	for _, t := range tensors {
		if len(cur) > 0 && size+t.bytes() > max {
			files, cur, size = append(files, cur), nil, 0
		}
		cur, size = append(cur, t), size+t.bytes()
	}
	return append(files, cur)
}

// fileName is Hugging Face's: model.safetensors alone, else numbered.
func fileName(i, n int) string {
	if n == 1 {
		return "model.safetensors"
	}
	return fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, n)
}

// writeFull writes one safetensors file of full tensors, each assembled
// from its pieces, and returns the bytes of tensor data written.
func (w *restoreWriter) writeFull(ctx context.Context, name string, ts []*fullTensor, meta map[string]string) (int64, error) {
	table := make([]safetensors.Tensor, len(ts))
	var off int64
	for i, t := range ts {
		table[i] = safetensors.Tensor{Name: t.name, DType: t.dtype, Shape: t.shape, Begin: off, End: off + t.bytes()}
		off += t.bytes()
	}
	header, err := safetensors.EncodeHeader(table, meta)
	if err != nil {
		return 0, err
	}
	f, err := w.create(name)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	if _, err := f.Write(header); err != nil {
		return 0, err
	}
	for i, t := range ts {
		for _, pc := range t.pieces {
			if err := w.writePiece(ctx, f, int64(len(header))+table[i].Begin, t, pc); err != nil {
				return 0, err
			}
		}
	}
	if err := f.Truncate(int64(len(header)) + off); err != nil { // a tensor of no elements writes nothing
		return 0, err
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return off, f.Close()
}

// writePiece reads one piece from storage and writes its rows where they
// belong in the full tensor, which starts at base in f.
func (w *restoreWriter) writePiece(ctx context.Context, f *os.File, base int64, t *fullTensor, pc piece) error {
	if pc.t.Length == 0 {
		return nil
	}
	buf, err := w.store.ReadTensor(ctx, pc.m, pc.t, checkpoint.ReadOptions{})
	if err != nil {
		return err
	}
	elem := int64(t.dtype.Size())
	for src, dst := range runs(t.shape, pc.t.Shape, pc.offsets) {
		run := buf[src.begin*elem : src.end*elem]
		if _, err := f.WriteAt(run, base+dst*elem); err != nil {
			return err
		}
	}
	return nil
}

// writeIndex writes model.safetensors.index.json: which file holds each
// tensor.
func (w *restoreWriter) writeIndex(files [][]*fullTensor, total int64) error {
	index := struct {
		Metadata  map[string]int64  `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}{map[string]int64{"total_size": total}, map[string]string{}}
	for i, ts := range files {
		for _, t := range ts {
			index.WeightMap[t.name] = fileName(i, len(files))
		}
	}
	b, err := json.MarshalIndent(index, "", "  ")
	if err != nil {
		return err
	}
	return w.writeFile("model.safetensors.index.json", append(b, '\n'))
}

// hfConfig is the tensor in which ckptd.torch saves a Hugging Face
// model's config.json (rank 0).
const hfConfig = "hf.config.json"

// writeHFConfig writes config.json from rank 0's hf.config.json tensor,
// when it has one, so that from_pretrained loads the folder.
func (w *restoreWriter) writeHFConfig(ctx context.Context, m *checkpoint.Manifest) error {
	b, err := readJSONTensor(ctx, w.store, m, hfConfig)
	if b == nil || err != nil {
		return err
	}
	return w.writeFile("config.json", b)
}

// writeFile writes a small file among the export's.
func (w *restoreWriter) writeFile(name string, b []byte) error {
	f, err := w.create(name)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}
