package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/safetensors"
)

type exportOptions struct {
	storageOptions
	stepChoice
	Out           string
	Format        string
	MaxShardSize  byteSize
	WithOptimizer bool
	// ModelConfig is a config.json, or a folder holding one, to write into the
	// export (for from_pretrained); RequireModelConfig fails the export when
	// neither it nor the step has one; Plain exports a step saved with
	// Client.save(model.state_dict()): rank 0's tensors without a group.
	ModelConfig        string
	RequireModelConfig bool
	Plain              bool
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
all are written.

For transformers' from_pretrained the folder needs config.json as well:
export writes the one ckptd.torch.save_state_dict records when given the
model itself (a module with a config), or the one --model-config names (a
config.json, or a folder holding one, such as the folder the model was
loaded from). Without either it writes the weights and says what is
missing; --require-model-config makes that an error (exit 1, nothing written).
A step saved with Client.save(model.state_dict()) names its tensors by the
state dict's keys, with no "model:" group: --plain exports those.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.stepChoice.check(cmd.Flags()); err != nil {
				return err
			}
			switch {
			case o.Out == "":
				return usageError{errors.New("--out DIR is required")}
			case o.Format != "safetensors":
				return usageError{fmt.Errorf("--format %q: only safetensors is supported", o.Format)}
			case o.MaxShardSize <= 0:
				return usageError{fmt.Errorf("--max-shard-size must be positive, got %d", o.MaxShardSize)}
			}
			return runExport(cmd.Context(), o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	o.storageOptions.registerInteractive(fs)
	o.stepChoice.register(fs, "export")
	fs.StringVar(&o.Out, "out", "", "folder to write into (created if missing)")
	fs.StringVar(&o.Format, "format", "safetensors", "output format (safetensors)")
	fs.Var(&o.MaxShardSize, "max-shard-size", "largest file to write; a larger tensor gets a file of its own")
	fs.BoolVar(&o.WithOptimizer, "with-optimizer", false, "also export the optimizer's tensors, named optimizer.<name>")
	fs.StringVar(&o.ModelConfig, "model-config", "", "config.json to write into the export, or a folder holding one (default: the one the step records)")
	fs.BoolVar(&o.RequireModelConfig, "require-model-config", false, "fail, writing nothing, when no config.json is available (from_pretrained needs one)")
	fs.BoolVar(&o.Plain, "plain", false, "export rank 0's tensors as named, for a step saved with Client.save(model.state_dict())")
	return cmd
}

func runExport(ctx context.Context, o *exportOptions, stdout, stderr io.Writer) error {
	given, err := readConfigFlag(o.ModelConfig)
	if err != nil {
		return err
	}
	store, rec, closeStore, err := o.openStep(ctx, o.stepChoice, true, stderr)
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
	tensors, err := planExport(ctx, store, ms, exportGroups(o.WithOptimizer, o.Plain))
	if err != nil {
		return err
	}
	if len(tensors) == 0 {
		return noTensors(rec.Step, ms[0], o.Plain)
	}
	config, err := readJSONTensor(ctx, store, ms[0], hfConfig)
	if err != nil {
		return err
	}
	switch {
	case given != nil:
		config = given
	case config == nil && o.RequireModelConfig:
		return fmt.Errorf("step %d: %w: %s", rec.Step, errNoConfig, missingConfig)
	case config == nil:
		fmt.Fprintf(stderr, "ckptd export: note: step %d records no model config, so the folder gets no config.json and "+
			"from_pretrained cannot load it: %s (--require-model-config makes this an error)\n", rec.Step, missingConfig)
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
	if config != nil {
		if err := w.writeFile("config.json", config); err != nil {
			return err
		}
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
	header, err := safetensors.EncodeHeader(safetensors.ForFile(table, meta)) // the format's dtypes
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
// model's config.json (rank 0), which export writes as config.json so
// that from_pretrained loads the folder.
const hfConfig = "hf.config.json"

// errNoConfig: --require-model-config, and no config.json to write.
var errNoConfig = errors.New("no model config to write config.json from")

// missingConfig says how to supply a config.json.
const missingConfig = "save the step with ckptd.torch.save_state_dict(client, step, model) given the transformers model " +
	"itself (not its state_dict: it records model.config), or give --model-config with the model's config.json " +
	"(or the folder holding it, such as the one the model was loaded from)"

// readConfigFlag reads --model-config: a config.json, or a folder holding one.
// It must be a JSON object (as transformers writes). nil when not given.
func readConfigFlag(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		path = filepath.Join(path, "config.json")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, usageError{fmt.Errorf("--model-config: %w (give a config.json, or a folder holding one)", err)}
	}
	var obj map[string]any
	if err := json.Unmarshal(b, &obj); err != nil {
		return nil, usageError{fmt.Errorf("--model-config %s is not a JSON object, as a model's config.json is: %v", path, err)}
	}
	return b, nil
}

// noTensors is the error of a step with nothing to export, saying what
// would make it exportable.
func noTensors(step int64, m *checkpoint.Manifest, plain bool) error {
	var plainNames []string
	for _, t := range m.Tensors {
		if !strings.Contains(t.Name, ":") && !reservedName(t.Name) {
			plainNames = append(plainNames, t.Name)
		}
	}
	if len(plainNames) > 0 && !plain {
		return fmt.Errorf("step %d: %w: export takes the tensors named model:<name> (as ckptd.torch.save_state_dict names them) "+
			"or described in %s, and this step's %d tensors are named by their state dict keys (%q, ...), as "+
			"Client.save(step, model.state_dict()) stores them: add --plain to export those under their names "+
			"(and --model-config for from_pretrained's config.json), or save with ckptd.torch.save_state_dict",
			step, errNoTensors, shardingTensor, len(plainNames), plainNames[0])
	}
	return fmt.Errorf("step %d: %w to export: none named model:<name> (ckptd.torch.save_state_dict), none described in %s (ckptd.dcp)"+
		", none without a group (--plain, Client.save(model.state_dict())); `ckptd restore` writes every tensor as saved",
		step, errNoTensors, shardingTensor)
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
