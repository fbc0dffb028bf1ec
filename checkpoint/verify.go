package checkpoint

import (
	"context"
	"fmt"
)

// VerifyReport summarizes a verified step.
type VerifyReport struct {
	Step      int64
	WorldSize int
	Chunks    int
	Bytes     int64 // raw bytes checked
}

// Verify reads every chunk of every rank of a committed step and checks it
// against the manifest's hash; the first failure is returned as an
// ErrCorrupt error naming the step, rank and chunk.
func (s *Store) Verify(ctx context.Context, step int64, latest bool, opts ReadOptions) (*VerifyReport, error) {
	rec, err := s.Resolve(ctx, step, latest)
	if err != nil {
		return nil, err
	}
	rep := &VerifyReport{Step: rec.Step, WorldSize: rec.WorldSize}
	for rank := range rec.WorldSize {
		m, err := s.Manifest(ctx, rec, rank)
		if err != nil {
			return nil, err
		}
		if err := s.ReadShard(ctx, m, nil, opts); err != nil {
			return nil, fmt.Errorf("verify: %w", err)
		}
		rep.Chunks += len(m.Chunks)
		rep.Bytes += m.DataSize
	}
	return rep, nil
}
