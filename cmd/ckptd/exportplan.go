package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// How `ckptd export` finds full tensors in a step's rank shards.
//
// A rank whose tensors are pieces of larger ones (FSDP, DTensor, DCP)
// carries a U8 tensor named "ckptd.sharding" holding JSON: for each piece,
// the group it belongs to (model, optimizer, extra), its name in that group
// (fqn), the full tensor's shape and the piece's offsets in it. ckptd.dcp
// and ckptd.torch write it. A step without one holds whole tensors on every
// rank (replicated state): rank 0's "model:<fqn>" and "optimizer:<path>"
// tensors are the full ones.

const shardingTensor = "ckptd.sharding"

// maxShardingJSON bounds the description a rank may carry.
const maxShardingJSON = 64 << 20

type shardingDoc struct {
	Format  string                   `json:"format"`
	Version int                      `json:"version"`
	Tensors map[string]shardingPiece `json:"tensors"`
}

type shardingPiece struct {
	Group       string  `json:"group"`
	FQN         string  `json:"fqn"`
	GlobalShape []int64 `json:"global_shape"`
	Offsets     []int64 `json:"offsets"`
}

// piece is part of a full tensor: a tensor of one rank's shard.
type piece struct {
	m       *checkpoint.Manifest
	t       checkpoint.Tensor
	offsets []int64
}

// fullTensor is one tensor of the export, and the pieces it is made of.
type fullTensor struct {
	name   string
	dtype  dtype.DType
	shape  []int64
	pieces []piece
}

func (f *fullTensor) bytes() int64 {
	n, _ := f.dtype.NumBytes(f.shape) // checked by addPiece
	return n
}

// exportGroups says which groups go into the export, and the prefix their
// tensors' names get there. plain adds the group "": the tensors of a
// step saved with Client.save(model.state_dict()), named by their keys.
func exportGroups(withOptimizer, plain bool) map[string]string {
	g := map[string]string{"model": ""}
	if withOptimizer {
		g["optimizer"] = "optimizer."
	}
	if plain {
		g[""] = ""
	}
	return g
}

// reservedName says whether a tensor name is one of ckptd's own (the
// skeleton, the sharding description, a record of the Python client, the
// model's config), never a tensor of the model.
func reservedName(name string) bool {
	return strings.HasPrefix(name, "ckptd.") || name == hfConfig
}

// planExport returns the full tensors of the step whose rank manifests ms
// are, sorted by name, each with the pieces to assemble it from.
func planExport(ctx context.Context, s *checkpoint.Store, ms []*checkpoint.Manifest, groups map[string]string) ([]*fullTensor, error) {
	docs := make([]*shardingDoc, len(ms))
	described := 0
	for i, m := range ms {
		doc, err := readSharding(ctx, s, m)
		if err != nil {
			return nil, err
		}
		if doc != nil {
			docs[i] = doc
			described++
		}
	}
	switch {
	case described == 0:
		return replicated(ms[0], groups)
	case hasGroup(groups, ""):
		return nil, usageError{fmt.Errorf("step %d is sharded (%s): --plain is for steps saved whole with Client.save; export it without --plain", ms[0].Step, shardingTensor)}
	case described < len(ms):
		return nil, fmt.Errorf("%w: step %d: %d of %d ranks describe their pieces (%s); a step is sharded on every rank or on none",
			checkpoint.ErrCorrupt, ms[0].Step, described, len(ms), shardingTensor)
	}
	p := planner{byName: map[string]*fullTensor{}}
	for i, m := range ms {
		if err := p.addRank(m, docs[i], groups); err != nil {
			return nil, err
		}
	}
	return p.finish()
}

// readSharding reads and parses m's sharding description, or returns nil
// when it has none.
func readSharding(ctx context.Context, s *checkpoint.Store, m *checkpoint.Manifest) (*shardingDoc, error) {
	b, err := readJSONTensor(ctx, s, m, shardingTensor)
	if b == nil || err != nil {
		return nil, err
	}
	var doc shardingDoc
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil || doc.Format != "ckptd.sharding" || doc.Version != 1 {
		return nil, fmt.Errorf("%w: step %d rank %d: %s is not a version 1 ckptd.sharding document (%v)",
			checkpoint.ErrCorrupt, m.Step, m.Rank, shardingTensor, err)
	}
	return &doc, nil
}

// readJSONTensor returns the bytes of m's U8 tensor name, which holds
// JSON, or nil when m has no such tensor.
func readJSONTensor(ctx context.Context, s *checkpoint.Store, m *checkpoint.Manifest, name string) ([]byte, error) {
	i := slices.IndexFunc(m.Tensors, func(t checkpoint.Tensor) bool { return t.Name == name })
	if i < 0 {
		return nil, nil
	}
	t := m.Tensors[i]
	if t.DType != dtype.U8 || t.Length > maxShardingJSON {
		return nil, fmt.Errorf("%w: step %d rank %d: %s is %s of %d bytes, want U8 of at most %d",
			checkpoint.ErrCorrupt, m.Step, m.Rank, name, t.DType, t.Length, maxShardingJSON)
	}
	b, err := s.ReadTensor(ctx, m, t, checkpoint.ReadOptions{})
	if err != nil {
		return nil, err
	}
	if !json.Valid(b) {
		return nil, fmt.Errorf("%w: step %d rank %d: %s is not JSON", checkpoint.ErrCorrupt, m.Step, m.Rank, name)
	}
	return b, nil
}

// replicated plans an export from rank 0 of a step without sharding
// descriptions: ckptd.torch's "model:<fqn>" and "optimizer:<a>:<b>" names.
func replicated(m *checkpoint.Manifest, groups map[string]string) ([]*fullTensor, error) {
	p := planner{byName: map[string]*fullTensor{}}
	for _, t := range m.Tensors {
		group, fqn, ok := strings.Cut(t.Name, ":")
		if !ok { // a plain save's name, exported with --plain
			if reservedName(t.Name) {
				continue
			}
			group, fqn = "", t.Name
		}
		fqn = strings.ReplaceAll(fqn, ":", ".")
		if err := p.addPiece(m, t, shardingPiece{Group: group, FQN: fqn, GlobalShape: t.Shape, Offsets: make([]int64, len(t.Shape))}, groups); err != nil {
			return nil, err
		}
	}
	return p.finish()
}

func hasGroup(groups map[string]string, g string) bool {
	_, ok := groups[g]
	return ok
}

type planner struct {
	byName map[string]*fullTensor
}

func (p *planner) addRank(m *checkpoint.Manifest, doc *shardingDoc, groups map[string]string) error {
	for _, t := range m.Tensors {
		sp, ok := doc.Tensors[t.Name]
		if !ok {
			continue
		}
		if err := p.addPiece(m, t, sp, groups); err != nil {
			return err
		}
	}
	for name := range doc.Tensors {
		if !slices.ContainsFunc(m.Tensors, func(t checkpoint.Tensor) bool { return t.Name == name }) {
			return fmt.Errorf("%w: step %d rank %d: %s describes %q, which the shard lacks", checkpoint.ErrCorrupt, m.Step, m.Rank, shardingTensor, name)
		}
	}
	return nil
}

// addPiece adds tensor t of m, described by sp, to its full tensor if its
// group is exported.
func (p *planner) addPiece(m *checkpoint.Manifest, t checkpoint.Tensor, sp shardingPiece, groups map[string]string) error {
	prefix, ok := groups[sp.Group]
	if !ok {
		return nil
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: step %d rank %d tensor %q: %s", checkpoint.ErrCorrupt, m.Step, m.Rank, t.Name, fmt.Sprintf(format, args...))
	}
	if sp.FQN == "" || len(sp.Offsets) != len(sp.GlobalShape) || len(t.Shape) != len(sp.GlobalShape) {
		return bad("fqn %q, offsets %v and shape %v do not fit the full shape %v", sp.FQN, sp.Offsets, t.Shape, sp.GlobalShape)
	}
	for d := range sp.GlobalShape {
		if sp.Offsets[d] < 0 || t.Shape[d] < 0 || sp.Offsets[d] > sp.GlobalShape[d]-t.Shape[d] {
			return bad("offsets %v and shape %v reach past the full shape %v", sp.Offsets, t.Shape, sp.GlobalShape)
		}
	}
	name := prefix + sp.FQN
	ft := p.byName[name]
	if ft == nil {
		if _, err := t.DType.NumBytes(sp.GlobalShape); err != nil {
			return bad("full shape %v: %v", sp.GlobalShape, err)
		}
		ft = &fullTensor{name: name, dtype: t.DType, shape: sp.GlobalShape}
		p.byName[name] = ft
	}
	if ft.dtype != t.DType || !slices.Equal(ft.shape, sp.GlobalShape) {
		return bad("%s %v, but another piece of %s is %s %v", t.DType, sp.GlobalShape, name, ft.dtype, ft.shape)
	}
	ft.pieces = append(ft.pieces, piece{m: m, t: t, offsets: sp.Offsets})
	return nil
}

// finish drops replicated copies of a piece and checks that each full
// tensor's pieces cover it exactly.
func (p *planner) finish() ([]*fullTensor, error) {
	var out []*fullTensor
	for _, ft := range p.byName {
		ft.pieces = uniquePieces(ft.pieces)
		if err := ft.checkTiling(); err != nil {
			return nil, err
		}
		out = append(out, ft)
	}
	slices.SortFunc(out, func(a, b *fullTensor) int { return strings.Compare(a.name, b.name) })
	return out, nil
}

// uniquePieces keeps one copy of pieces with the same box (replicas).
func uniquePieces(ps []piece) []piece {
	var out []piece
	for _, pc := range ps {
		if !slices.ContainsFunc(out, func(q piece) bool { return slices.Equal(q.offsets, pc.offsets) && slices.Equal(q.t.Shape, pc.t.Shape) }) {
			out = append(out, pc)
		}
	}
	return out
}

// maxPairwise bounds the pieces of one tensor checked pairwise for
// overlap; beyond it, only their total size is checked.
const maxPairwise = 512

// checkTiling checks that the pieces hold exactly the full tensor's
// elements: together as many as it has, and (for up to maxPairwise pieces)
// no two overlapping, so none is missing.
func (f *fullTensor) checkTiling() error {
	var total int64
	want := numel(f.shape)
	for _, pc := range f.pieces {
		if total += numel(pc.t.Shape); total > want { // each piece is at most want: no overflow
			break
		}
	}
	if total != want {
		return fmt.Errorf("%w: the pieces of %s hold %d elements, the full tensor %v has %d", checkpoint.ErrCorrupt, f.name, total, f.shape, want)
	}
	if len(f.pieces) > maxPairwise {
		return nil
	}
	for i, a := range f.pieces {
		for _, b := range f.pieces[i+1:] {
			if overlap(a, b) {
				return fmt.Errorf("%w: pieces of %s overlap: at %v %v (rank %d) and at %v %v (rank %d)", checkpoint.ErrCorrupt,
					f.name, a.offsets, a.t.Shape, a.m.Rank, b.offsets, b.t.Shape, b.m.Rank)
			}
		}
	}
	return nil
}

func overlap(a, b piece) bool {
	if numel(a.t.Shape) == 0 || numel(b.t.Shape) == 0 {
		return false
	}
	for d := range a.offsets {
		if a.offsets[d]+a.t.Shape[d] <= b.offsets[d] || b.offsets[d]+b.t.Shape[d] <= a.offsets[d] {
			return false
		}
	}
	return true
}

func numel(shape []int64) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}

// errNoTensors: the step holds nothing the export would write.
var errNoTensors = errors.New("no model tensors")
