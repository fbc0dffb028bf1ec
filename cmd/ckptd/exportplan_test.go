package main

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// Pieces that do not make up their full tensor exactly are refused as
// corrupt, naming it; replicas of one piece count once.
func TestPlanChecksPieces(t *testing.T) {
	m := &checkpoint.Manifest{Step: 1}
	f32 := func(shape ...int64) checkpoint.Tensor {
		return checkpoint.Tensor{Name: "p", DType: dtype.F32, Shape: shape}
	}
	desc := func(offsets ...int64) shardingPiece {
		return shardingPiece{Group: "model", FQN: "w", GlobalShape: []int64{4, 4}, Offsets: offsets}
	}
	type add struct {
		t  checkpoint.Tensor
		sp shardingPiece
	}
	for _, tc := range []struct {
		name string
		adds []add
		ok   bool
	}{
		{"halves", []add{{f32(2, 4), desc(0, 0)}, {f32(2, 4), desc(2, 0)}}, true},
		{"replicated halves", []add{{f32(2, 4), desc(0, 0)}, {f32(2, 4), desc(0, 0)}, {f32(2, 4), desc(2, 0)}}, true},
		{"a gap", []add{{f32(2, 4), desc(0, 0)}}, false},
		{"overlap and gap", []add{{f32(3, 4), desc(0, 0)}, {f32(1, 4), desc(2, 0)}}, false},
		{"past the end", []add{{f32(2, 4), desc(3, 0)}}, false},
		{"rank mismatch", []add{{f32(16), desc(0, 0)}}, false},
		{"other dtype", []add{{f32(2, 4), desc(0, 0)}, {checkpoint.Tensor{DType: dtype.BF16, Shape: []int64{2, 4}}, desc(2, 0)}}, false},
	} {
		p := planner{byName: map[string]*fullTensor{}}
		var err error
		for _, a := range tc.adds {
			if err = p.addPiece(m, a.t, a.sp, exportGroups(false, false)); err != nil {
				break
			}
		}
		if err == nil {
			_, err = p.finish()
		}
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, checkpoint.ErrCorrupt) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// A stored sharding description is untrusted: whatever its numbers, the
// planner refuses it or plans pieces that lie inside their full tensor.
func FuzzShardingDoc(f *testing.F) {
	f.Add([]byte(`{"format":"ckptd.sharding","version":1,"tensors":{"a":{"group":"model","fqn":"w","global_shape":[4,4],"offsets":[2,0]}}}`), []byte{2, 4})
	f.Add([]byte(`{"format":"ckptd.sharding","version":1,"tensors":{"a":{"group":"model","fqn":"w","global_shape":[9223372036854775807,2],"offsets":[0,0]}}}`), []byte{1, 2})
	f.Fuzz(func(t *testing.T, doc []byte, shape []byte) {
		var d shardingDoc
		if json.Unmarshal(doc, &d) != nil {
			return
		}
		ts := make([]int64, len(shape))
		for i, s := range shape {
			ts[i] = int64(s)
		}
		m := &checkpoint.Manifest{}
		for name := range d.Tensors {
			m.Tensors = append(m.Tensors, checkpoint.Tensor{Name: name, DType: dtype.F32, Shape: ts})
		}
		p := planner{byName: map[string]*fullTensor{}}
		if p.addRank(m, &d, exportGroups(true, false)) != nil {
			return
		}
		fts, err := p.finish()
		if err != nil {
			return
		}
		for _, ft := range fts {
			for _, pc := range ft.pieces {
				if numel(pc.t.Shape) > 1<<16 {
					continue
				}
				for s, dst := range runs(ft.shape, pc.t.Shape, pc.offsets) {
					if s.begin < 0 || s.end > numel(pc.t.Shape) || dst < 0 || dst+s.end-s.begin > numel(ft.shape) {
						t.Fatalf("run %v at %d outside piece %v / full %v", s, dst, pc.t.Shape, ft.shape)
					}
				}
			}
		}
	})
}

// A step saved with Client.save(model.state_dict()) has no model: group:
// --plain exports its tensors under their names, never ckptd's own, and
// without it the refusal says to add it.
func TestPlainSaves(t *testing.T) {
	m := &checkpoint.Manifest{Step: 3}
	for _, name := range []string{"embeddings.weight", "encoder.0.bias", "ckptd.as:torch", "ckptd.torch", "hf.config.json", "optimizer:state:0:exp_avg"} {
		m.Tensors = append(m.Tensors, checkpoint.Tensor{Name: name, DType: dtype.F32, Shape: []int64{2}, Length: 8})
	}
	ts, err := replicated(m, exportGroups(false, false))
	if err != nil || len(ts) != 0 {
		t.Fatalf("without --plain: %d tensors, %v", len(ts), err)
	}
	err = noTensors(3, m, false)
	if !errors.Is(err, errNoTensors) || !strings.Contains(err.Error(), "add --plain") || !strings.Contains(err.Error(), `"embeddings.weight"`) {
		t.Fatalf("refusal: %v", err)
	}
	ts, err = replicated(m, exportGroups(false, true))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, ft := range ts {
		names = append(names, ft.name)
	}
	if !slices.Equal(names, []string{"embeddings.weight", "encoder.0.bias"}) {
		t.Fatalf("--plain exports %v", names)
	}
}
