package daemontest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/safetensors"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Shard builds rank's tensors for step: weights, an optimizer-like state,
// a step counter and an empty tensor, with content unique to (step, rank).
func Shard(step int64, rank, world int) *ckptd.SaveRequest {
	r := rand.New(rand.NewPCG(uint64(step), uint64(rank)))
	f32 := func(n int) []byte {
		b := make([]byte, 4*n)
		for i := range n {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(r.NormFloat64()*0.02)))
		}
		return b
	}
	return &ckptd.SaveRequest{
		Step: step, Rank: rank, WorldSize: world,
		Metadata: []byte(fmt.Sprintf(`{"loader_pos": %d}`, step*10+int64(rank))),
		Tensors: []ckptd.Tensor{
			{Name: "model.layers.0.weight", DType: "F32", Shape: []int64{1024, 1536}, Data: f32(1024 * 1536)},
			{Name: "optim.exp_avg", DType: "F32", Shape: []int64{300, 7}, Data: f32(2100)},
			{Name: "step", DType: "I64", Shape: []int64{}, Data: binary.LittleEndian.AppendUint64(nil, uint64(step))},
			{Name: "empty", DType: "BF16", Shape: []int64{0}, Data: nil},
		},
	}
}

// CheckShard fails the test unless got holds want's header and tensors.
func CheckShard(t *testing.T, got *ckptd.Shard, want *ckptd.SaveRequest) {
	t.Helper()
	if got.Step != want.Step || got.WorldSize != want.WorldSize || !bytes.Equal(got.Metadata, want.Metadata) {
		t.Fatalf("shard header: step %d world %d metadata %q", got.Step, got.WorldSize, got.Metadata)
	}
	byName := map[string]ckptd.Tensor{}
	for _, tn := range got.Tensors {
		byName[tn.Name] = tn
	}
	for _, w := range want.Tensors {
		g, ok := byName[w.Name]
		if !ok || g.DType != w.DType || fmt.Sprint(g.Shape) != fmt.Sprint(w.Shape) || !bytes.Equal(g.Data, w.Data) {
			t.Fatalf("tensor %s differs after restore", w.Name)
		}
	}
}

// CheckSafetensors compares a restored rank file with what was saved.
func CheckSafetensors(t *testing.T, path string, want *ckptd.SaveRequest) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	tensors, _, start, err := safetensors.ParseHeader(f, fi.Size())
	if err != nil {
		t.Fatal(err)
	}
	if len(tensors) != len(want.Tensors) {
		t.Fatalf("%s: %d tensors, want %d", path, len(tensors), len(want.Tensors))
	}
	for i, w := range want.Tensors {
		g := tensors[i]
		data := make([]byte, g.End-g.Begin)
		if _, err := f.ReadAt(data, start+g.Begin); err != nil && len(data) > 0 {
			t.Fatal(err)
		}
		if g.Name != w.Name || string(g.DType) != w.DType || !bytes.Equal(data, w.Data) {
			t.Fatalf("%s: tensor %d (%s) differs", path, i, g.Name)
		}
	}
}

// F32Tensor is a table entry of n float32 at off, for raw BeginSave calls.
func F32Tensor(name string, off, n uint64) *pb.Tensor {
	return &pb.Tensor{Name: name, Dtype: "F32", Shape: []int64{int64(n)}, Offset: off, Length: 4 * n}
}

// Target is rank 0 of 1 of step, of Attempt, for raw BeginSave calls.
func Target(step int64) *pb.SaveTarget {
	return &pb.SaveTarget{Step: step, WorldSize: 1, Attempt: Attempt}
}
