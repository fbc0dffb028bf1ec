package safetensors

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// python returns an interpreter that can import safetensors and numpy:
// $CKPTD_PYTHON, the repository's .venv, or python3. Without one the
// interop tests skip, except under CI, where skipping would hide that the
// format is no longer checked against the reference implementation.
func python(t *testing.T) string {
	t.Helper()
	if p := findPython(); p != "" {
		return p
	}
	msg := "no Python with safetensors and numpy (tried $CKPTD_PYTHON, ../../.venv/bin/python, python3)"
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

var findPython = sync.OnceValue(func() string {
	candidates := []string{os.Getenv("CKPTD_PYTHON"), filepath.Join("..", "..", ".venv", "bin", "python"), "python3"}
	for _, p := range candidates {
		if p != "" && exec.Command(p, "-c", "import safetensors.numpy, numpy").Run() == nil {
			return p
		}
	}
	return ""
})

func runPython(t *testing.T, py, script string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, append([]string{"-c", script}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, stderr.String())
	}
	return out
}

// loadScript prints, for a file, each tensor's numpy dtype, shape and
// values, and the metadata, as JSON.
const loadScript = `
import json, sys
from safetensors import safe_open
from safetensors.numpy import load_file
out = {k: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.ravel().tolist()}
       for k, v in load_file(sys.argv[1]).items()}
with safe_open(sys.argv[1], "np") as f:
    out["__metadata__"] = f.metadata()
json.dump(out, sys.stdout)
`

// TestPythonLoadsOurFiles writes a file with EncodeHeader and checks the
// reference library reads back every tensor and the metadata.
func TestPythonLoadsOurFiles(t *testing.T) {
	py := python(t)
	path := filepath.Join(t.TempDir(), "rank-00000.safetensors")
	if err := os.WriteFile(path, sampleFile(t), 0o644); err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(runPython(t, py, loadScript, path), &got); err != nil {
		t.Fatal(err)
	}
	_, metadata := sampleTable()
	want := map[string]any{
		"embed.weight":      tensorJSONValue("float32", []any{2.0, 2.0}, 1.0, -2.0, 0.5, 3.25),
		"layers.0.bias":     tensorJSONValue("float16", []any{3.0}, 1.0, -2.0, 0.5),
		"empty":             tensorJSONValue("float64", []any{0.0, 5.0}),
		"mask":              tensorJSONValue("bool", []any{2.0}, true, false),
		"step":              tensorJSONValue("int64", []any{}, 9000.0),
		"odd \"name\"\\é\n": tensorJSONValue("uint8", []any{1.0, 1.0}, 171.0),
		"__metadata__":      map[string]any{"format": metadata["format"], "note": metadata["note"]},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("safetensors.numpy read:\n got %v\nwant %v", got, want)
	}
}

func tensorJSONValue(dt string, shape []any, values ...any) map[string]any {
	if values == nil {
		values = []any{}
	}
	return map[string]any{"dtype": dt, "shape": shape, "values": values}
}

// saveScript writes a file with the reference library and prints each
// tensor's raw bytes in hex, for comparison with what ParseHeader locates.
const saveScript = `
import json, sys
import numpy as np
from safetensors.numpy import save_file
ts = {
    "w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "h": np.array([1.5, -0.25], dtype=np.float16),
    "i": np.array([[-1, 2]], dtype=np.int32),
    "d": np.array(2.5, dtype=np.float64),
    "z": np.zeros((0,), dtype=np.int8),
    "u": np.array([7], dtype=np.uint16),
}
save_file(ts, sys.argv[1], metadata={"step": "9000"})
json.dump({k: v.tobytes().hex() for k, v in ts.items()}, sys.stdout)
`

// TestParsesPythonFiles reads a file the reference library wrote and
// checks every tensor's dtype, shape and bytes.
func TestParsesPythonFiles(t *testing.T) {
	py := python(t)
	path := filepath.Join(t.TempDir(), "ref.safetensors")
	var wantHex map[string]string
	if err := json.Unmarshal(runPython(t, py, saveScript, path), &wantHex); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	tensors, metadata, dataStart, err := ParseHeader(f, st.Size())
	if err != nil {
		t.Fatal(err)
	}
	if metadata["step"] != "9000" {
		t.Errorf("metadata = %q", metadata)
	}
	wantTypes := map[string]struct {
		dt    dtype.DType
		shape []int64
	}{
		"w": {dtype.F32, []int64{3, 4}}, "h": {dtype.F16, []int64{2}}, "i": {dtype.I32, []int64{1, 2}},
		"d": {dtype.F64, []int64{}}, "z": {dtype.I8, []int64{0}}, "u": {dtype.U16, []int64{1}},
	}
	if len(tensors) != len(wantTypes) {
		t.Fatalf("got %d tensors, want %d", len(tensors), len(wantTypes))
	}
	for _, ts := range tensors {
		w := wantTypes[ts.Name]
		if ts.DType != w.dt || !reflect.DeepEqual(ts.Shape, w.shape) {
			t.Errorf("%s: %s %v, want %s %v", ts.Name, ts.DType, ts.Shape, w.dt, w.shape)
		}
		data := make([]byte, ts.End-ts.Begin)
		if _, err := f.ReadAt(data, dataStart+ts.Begin); err != nil && len(data) > 0 {
			t.Fatal(err)
		}
		if got := hex.EncodeToString(data); got != wantHex[ts.Name] {
			t.Errorf("%s: bytes %s, want %s", ts.Name, got, wantHex[ts.Name])
		}
	}
}
