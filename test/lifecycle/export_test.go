package lifecycle

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/safetensors"
	"github.com/ckptd/ckptd/test/daemontest"
)

// f32s are n float32 values start, start+1, ...
func f32s(start, n int) []byte {
	b := make([]byte, 4*n)
	for i := range n {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(start+i)))
	}
	return b
}

type pieceDesc struct {
	Group       string  `json:"group"`
	FQN         string  `json:"fqn"`
	GlobalShape []int64 `json:"global_shape"`
	Offsets     []int64 `json:"offsets"`
}

// shardedRank is one rank's shard of a model sharded the FSDP way: w
// (4x6) by rows, v (2x4) by columns, the bias replicated, an optimizer
// piece, and a ckptd.sharding description of them.
func shardedRank(step int64, rank int) *ckptd.SaveRequest {
	w := f32s(rank*12, 12)                             // rows 2r, 2r+1 of 0..23
	v := append(f32s(rank*2, 2), f32s(4+rank*2, 2)...) // columns 2r, 2r+1 of [[0..3],[4..7]]
	desc := map[string]pieceDesc{
		"model:w":             {"model", "layer.w", []int64{4, 6}, []int64{int64(2 * rank), 0}},
		"model:v":             {"model", "layer.v", []int64{2, 4}, []int64{0, int64(2 * rank)}},
		"model:bias":          {"model", "layer.bias", []int64{6}, []int64{0}},
		"optimizer:w.exp_avg": {"optimizer", "state.layer.w.exp_avg", []int64{4, 6}, []int64{int64(2 * rank), 0}},
	}
	doc, _ := json.Marshal(map[string]any{"format": "ckptd.sharding", "version": 1, "tensors": desc})
	return &ckptd.SaveRequest{Step: step, Rank: rank, WorldSize: 2, Tensors: []ckptd.Tensor{
		{Name: "model:w", DType: "F32", Shape: []int64{2, 6}, Data: w},
		{Name: "model:v", DType: "F32", Shape: []int64{2, 2}, Data: v},
		{Name: "model:bias", DType: "F32", Shape: []int64{6}, Data: f32s(100, 6)},
		{Name: "optimizer:w.exp_avg", DType: "F32", Shape: []int64{2, 6}, Data: w},
		{Name: "extra:rng", DType: "U8", Shape: []int64{3}, Data: []byte{1, 2, 3}},
		{Name: "ckptd.sharding", DType: "U8", Shape: []int64{int64(len(doc))}, Data: doc},
	}}
}

// readSafetensors returns a file's tensors' bytes by name and its metadata.
func readSafetensors(t *testing.T, path string) (map[string][]byte, map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	tensors, meta, start, err := safetensors.ParseHeader(f, st.Size())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, tn := range tensors {
		b := make([]byte, tn.End-tn.Begin)
		if _, err := f.ReadAt(b, start+tn.Begin); err != nil && len(b) > 0 {
			t.Fatal(err)
		}
		out[tn.Name] = b
	}
	return out, meta
}

// ckptd export puts the pieces of a sharded step back together, under
// their state_dict names, in Hugging Face's file layout; --with-optimizer
// adds the optimizer; a plain ckptd.torch step exports rank 0's model.
func TestExport(t *testing.T) {
	d := daemontest.Start(t, "")
	c := d.Client()
	for rank := range 2 {
		if _, err := c.Save(daemontest.Ctx(t), shardedRank(3, rank)); err != nil {
			t.Fatal(err)
		}
	}
	plain := &ckptd.SaveRequest{Step: 4, WorldSize: 1, Tensors: []ckptd.Tensor{
		{Name: "model:fc.weight", DType: "F32", Shape: []int64{2, 2}, Data: f32s(0, 4)},
		{Name: "optimizer:state:0:exp_avg", DType: "F32", Shape: []int64{2, 2}, Data: f32s(9, 4)},
		{Name: "ckptd.torch", DType: "U8", Shape: []int64{2}, Data: []byte("{}")},
		{Name: "hf.config.json", DType: "U8", Shape: []int64{21}, Data: []byte(`{"model_type":"bert"}`)},
	}}
	if _, err := c.Save(daemontest.Ctx(t), plain); err != nil {
		t.Fatal(err)
	}
	for _, step := range []int64{3, 4} {
		if err := daemontest.WaitStep(t, c, step, 0); err != nil {
			t.Fatal(err)
		}
	}
	wantW := f32s(0, 24)
	wantV := f32s(0, 8)

	out := filepath.Join(t.TempDir(), "one")
	if stdout, stderr, err := daemontest.CLI(t, "export", "--storage", d.Storage, "--job", "e2e", "--step", "3", "--out", out); err != nil {
		t.Fatalf("ckptd export: %v\n%s%s", err, stdout, stderr)
	}
	got, meta := readSafetensors(t, filepath.Join(out, "model.safetensors"))
	if meta["format"] != "pt" || meta["ckptd.step"] != "3" || meta["ckptd.job"] != "e2e" || meta["ckptd.attempt"] == "" {
		t.Fatalf("metadata %v", meta)
	}
	if len(got) != 3 || !bytes.Equal(got["layer.w"], wantW) || !bytes.Equal(got["layer.v"], wantV) || !bytes.Equal(got["layer.bias"], f32s(100, 6)) {
		t.Fatalf("exported %d tensors; w %v", len(got), got["layer.w"])
	}

	many := filepath.Join(t.TempDir(), "many")
	if _, stderr, err := daemontest.CLI(t, "export", "--storage", d.Storage, "--job", "e2e", "--step", "99", "--out", many); err == nil ||
		!strings.Contains(stderr, "99") {
		t.Fatalf("export of a step never committed: %v %s", err, stderr)
	}
	if ents, _ := os.ReadDir(many); len(ents) != 0 {
		t.Fatalf("a failed export left %v", ents)
	}
	if _, stderr, err := daemontest.CLI(t, "export", "--storage", d.Storage, "--job", "e2e", "--step", "3", "--out", many,
		"--max-shard-size", "100", "--with-optimizer"); err != nil {
		t.Fatalf("ckptd export --max-shard-size: %v\n%s", err, stderr)
	}
	var index struct {
		Metadata  map[string]int64  `json:"metadata"`
		WeightMap map[string]string `json:"weight_map"`
	}
	b, err := os.ReadFile(filepath.Join(many, "model.safetensors.index.json"))
	if err != nil || json.Unmarshal(b, &index) != nil {
		t.Fatalf("index: %v %s", err, b)
	}
	if len(index.WeightMap) != 4 || index.Metadata["total_size"] != 4*(24+8+6+24) {
		t.Fatalf("index %+v", index)
	}
	all := map[string][]byte{}
	for name, file := range index.WeightMap {
		if !strings.HasPrefix(file, "model-0000") {
			t.Fatalf("file name %s", file)
		}
		ts, _ := readSafetensors(t, filepath.Join(many, file))
		all[name] = ts[name]
	}
	if !bytes.Equal(all["optimizer.state.layer.w.exp_avg"], wantW) || !bytes.Equal(all["layer.w"], wantW) {
		t.Fatalf("sharded export with the optimizer: %v", all)
	}

	flat := filepath.Join(t.TempDir(), "plain")
	if _, stderr, err := daemontest.CLI(t, "export", "--storage", d.Storage, "--job", "e2e", "--step", "4", "--out", flat); err != nil {
		t.Fatalf("ckptd export of a plain step: %v\n%s", err, stderr)
	}
	got, _ = readSafetensors(t, filepath.Join(flat, "model.safetensors"))
	if len(got) != 1 || !bytes.Equal(got["fc.weight"], f32s(0, 4)) {
		t.Fatalf("plain export: %v", got)
	}
	if cfg, err := os.ReadFile(filepath.Join(flat, "config.json")); err != nil || string(cfg) != `{"model_type":"bert"}` {
		t.Fatalf("config.json from hf.config.json: %q %v", cfg, err)
	}
}
