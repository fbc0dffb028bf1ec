package server

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/internal/peercred"
	"github.com/ckptd/ckptd/prefetch"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Prefetch implements pb.PrefetchServer.
type Prefetch struct {
	pb.UnimplementedPrefetchServer
	svc *prefetch.Service
}

// RegisterPrefetch adds the prefetch service for svc to s.
func RegisterPrefetch(s *grpc.Server, svc *prefetch.Service) {
	pb.RegisterPrefetchServer(s, &Prefetch{svc: svc})
}

// owner is the connection a call came on: what it opens belongs to it and
// is closed when it closes. Without one (a listener that does not say) it
// is the zero Owner.
func owner(ctx context.Context) prefetch.Owner {
	info, ok := peercred.FromContext(ctx)
	if !ok {
		return prefetch.Owner{}
	}
	return prefetch.Owner{ID: info.ID, Done: info.Done()}
}

func (p *Prefetch) OpenDataset(ctx context.Context, req *pb.OpenDatasetRequest) (*pb.OpenDatasetResponse, error) {
	spec := prefetch.Spec{
		Format: prefetch.Format(req.GetFormat()), BatchSize: int(req.GetBatchSize()),
		Rank: int(req.GetRank()), WorldSize: int(req.GetWorldSize()), Seed: req.GetSeed(),
		Epoch: req.GetEpoch(), Start: req.GetStart(), ShuffleWindow: int(req.GetShuffleWindow()),
		SkipCorrupt: req.GetSkipCorrupt(),
	}
	if req.GetSource() == "" {
		return nil, status.Error(codes.InvalidArgument, "dataset source is empty")
	}
	id, st, err := p.svc.OpenSession(ctx, owner(ctx), req.GetSource(), spec)
	if err != nil {
		return nil, pfStatus(err)
	}
	return &pb.OpenDatasetResponse{Session: id, Shards: int64(st.Shards)}, nil
}

func (p *Prefetch) NextBatch(ctx context.Context, req *pb.NextBatchRequest) (*pb.NextBatchResponse, error) {
	d, lease, st, err := p.svc.Next(ctx, owner(ctx), req.GetSession(), req.GetRelease())
	if errors.Is(err, io.EOF) {
		return &pb.NextBatchResponse{End: true, Stats: toPrefetchStats(st)}, nil
	}
	if err != nil {
		return nil, pfStatus(err)
	}
	resp := &pb.NextBatchResponse{
		Lease:    &pb.Lease{Id: lease, Offset: uint64(d.Region.Offset), Length: uint64(d.Region.Length), ArenaId: p.svc.ArenaID()},
		Position: d.Position, Stats: toPrefetchStats(st), Samples: make([]*pb.Sample, len(d.Samples)),
	}
	for i, s := range d.Samples {
		ps := &pb.Sample{Key: s.Key, Fields: make([]*pb.SampleField, len(s.Fields))}
		for j, f := range s.Fields {
			ps.Fields[j] = &pb.SampleField{Name: f.Name, Offset: uint64(f.Offset), Length: uint64(f.Length)}
		}
		resp.Samples[i] = ps
	}
	return resp, nil
}

func (p *Prefetch) CloseDataset(ctx context.Context, req *pb.CloseDatasetRequest) (*pb.CloseDatasetResponse, error) {
	return &pb.CloseDatasetResponse{}, pfStatus(p.svc.CloseSession(owner(ctx), req.GetSession()))
}

func toPrefetchStats(st prefetch.Stats) *pb.PrefetchStats {
	return &pb.PrefetchStats{
		WaitStorageNs: st.WaitStorage.Nanoseconds(), WaitCacheNs: st.WaitCache.Nanoseconds(),
		WaitRingNs: st.WaitRing.Nanoseconds(), WaitWorkNs: st.WaitWork.Nanoseconds(),
		CacheHits: st.CacheHits, CacheMisses: st.CacheMisses, CorruptSkipped: st.CorruptSkipped,
	}
}

// pfStatus is toStatus with the prefetch service's own errors: its bounds
// (the datasets' share of the arena, the open sources) are
// RESOURCE_EXHAUSTED, and a source --dataset-allow does not list is
// PERMISSION_DENIED.
func pfStatus(err error) error {
	switch {
	case errors.Is(err, prefetch.ErrOverBudget):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, prefetch.ErrNotAllowed):
		return status.Error(codes.PermissionDenied, err.Error())
	}
	return toStatus(err)
}
