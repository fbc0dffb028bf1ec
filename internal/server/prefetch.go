package server

import (
	"context"
	"errors"
	"io"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/peercred"
	"github.com/ckptd/ckptd/prefetch"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Prefetch implements pb.PrefetchServer.
type Prefetch struct {
	pb.UnimplementedPrefetchServer
	svc   *prefetch.Service
	arena *arena.Arena
}

// RegisterPrefetch adds the prefetch service for svc to s; a is the arena
// its batches are delivered in (PrefetchArena(a)).
func RegisterPrefetch(s grpc.ServiceRegistrar, svc *prefetch.Service, a *arena.Arena) {
	pb.RegisterPrefetchServer(s, &Prefetch{svc: svc, arena: a})
}

// pfOwner is the connection a call came on: what it opens belongs to it
// and is closed when it closes. Without one (a listener that does not say)
// it is the zero Owner.
func pfOwner(ctx context.Context) prefetch.Owner {
	info, ok := peercred.FromContext(ctx)
	if !ok {
		return prefetch.Owner{}
	}
	return prefetch.Owner{ID: info.ID, Done: info.Done(), Peer: peerName(info)}
}

func (p *Prefetch) OpenDataset(ctx context.Context, req *pb.OpenDatasetRequest) (*pb.OpenDatasetResponse, error) {
	spec := prefetch.Spec{
		Format: prefetch.Format(req.GetFormat()), BatchSize: int(req.GetBatchSize()),
		Rank: int(req.GetRank()), WorldSize: int(req.GetWorldSize()), Seed: req.GetSeed(),
		Epoch: req.GetEpoch(), Start: req.GetStart(), ShuffleWindow: int(req.GetShuffleWindow()), ShuffleBlock: int(req.GetShuffleBlock()),
		SkipCorrupt: req.GetSkipCorrupt(), Even: prefetch.Even(req.GetEven()), BatchDelivered: req.GetBatchDelivered(),
	}
	mix := req.GetMixture()
	switch {
	case len(mix) > 0 && req.GetSource() != "":
		return nil, status.Error(codes.InvalidArgument, "a dataset names a source or a mixture, not both")
	case len(mix) == 0 && req.GetSource() == "":
		return nil, status.Error(codes.InvalidArgument, "dataset source is empty")
	}
	for _, blob := range req.GetDelivered() {
		d, err := prefetch.DecodeDelivered(blob)
		if err != nil {
			return nil, toStatus(err)
		}
		if spec.Delivered == nil {
			spec.Delivered = prefetch.NewDelivered()
		}
		spec.Delivered.Union(d)
	}
	start, o := time.Now(), pfOwner(ctx)
	var id string
	var st prefetch.Stats
	var err error
	if len(mix) > 0 {
		sources := make([]prefetch.MixtureSource, len(mix))
		for i, m := range mix {
			if m.GetSource() == "" {
				return nil, status.Errorf(codes.InvalidArgument, "mixture source %d is empty", i)
			}
			sources[i] = prefetch.MixtureSource{Source: m.GetSource(), Format: prefetch.Format(m.GetFormat()), Weight: m.GetWeight()}
		}
		id, st, err = p.svc.OpenMixture(ctx, o, sources, spec)
	} else {
		id, st, err = p.svc.OpenSession(ctx, o, req.GetSource(), spec)
	}
	if err != nil {
		return nil, toStatus(err)
	}
	if tooLate(ctx, start) { // the client would never learn the session's id
		_ = p.svc.CloseSession(o, id)
		return nil, status.Error(codes.DeadlineExceeded, "the call's deadline came as the dataset opened; it was closed again")
	}
	return &pb.OpenDatasetResponse{Session: id, Shards: int64(st.Shards)}, nil
}

// NextBatch hands out the session's next batch. A batch whose response
// cannot be sent is never left held by a client that did not get it: one
// that fails validation (proto strings must be UTF-8) is released, and one
// whose call ended (or is about to) while it was being answered is put
// back for the next call. Should the response still be lost on the way,
// the client's next release frees its slot (deliveries are released in
// order), though its samples are not delivered again.
func (p *Prefetch) NextBatch(ctx context.Context, req *pb.NextBatchRequest) (*pb.NextBatchResponse, error) {
	start, o := time.Now(), pfOwner(ctx)
	d, lease, st, err := p.svc.Next(ctx, o, req.GetSession(), req.GetRelease())
	if errors.Is(err, io.EOF) {
		return &pb.NextBatchResponse{End: true, Stats: toPrefetchStats(st)}, nil
	}
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &pb.NextBatchResponse{
		Lease:    &pb.Lease{Id: lease, Offset: uint64(d.Region.Offset), Length: uint64(d.Region.Length), ArenaId: p.arena.ID()},
		Position: d.Position, Stats: toPrefetchStats(st), Samples: make([]*pb.Sample, len(d.Samples)),
		Delivered: d.Delivered,
	}
	for i, s := range d.Samples {
		ps := &pb.Sample{Key: s.Key, Fields: make([]*pb.SampleField, len(s.Fields))}
		valid := utf8.ValidString(s.Key)
		for j, f := range s.Fields {
			ps.Fields[j] = &pb.SampleField{Name: f.Name, Offset: uint64(f.Offset), Length: uint64(f.Length)}
			valid = valid && utf8.ValidString(f.Name)
		}
		if !valid {
			_ = p.svc.Release(o, req.GetSession(), lease)
			return nil, status.Errorf(codes.Internal, "dataset session %s: sample %q at position %d has a key or field name that is not UTF-8 (the prefetcher should have refused it)",
				req.GetSession(), s.Key, d.Position)
		}
		resp.Samples[i] = ps
	}
	if tooLate(ctx, start) {
		p.svc.Undeliver(o, req.GetSession(), lease)
		return nil, status.Error(codes.DeadlineExceeded, "the call's deadline came as its batch did; the next call gets the batch")
	}
	return resp, nil
}

// tooLate reports whether a response sent now would likely reach the
// client after its deadline: the call's context is over, or less is left
// of it than the time the response takes to travel (a margin of at most
// 2 ms, and at most half the time the call had here).
func tooLate(ctx context.Context, start time.Time) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	if !ok {
		return false
	}
	margin := min(2*time.Millisecond, dl.Sub(start)/2)
	return time.Until(dl) < margin
}

func (p *Prefetch) CloseDataset(ctx context.Context, req *pb.CloseDatasetRequest) (*pb.CloseDatasetResponse, error) {
	return &pb.CloseDatasetResponse{}, toStatus(p.svc.CloseSession(pfOwner(ctx), req.GetSession()))
}

func (p *Prefetch) DatasetPosition(ctx context.Context, req *pb.DatasetPositionRequest) (*pb.DatasetPositionResponse, error) {
	b, n, err := p.svc.Position(pfOwner(ctx), req.GetSession(), req.GetPosition())
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.DatasetPositionResponse{Delivered: b, Samples: n}, nil
}

func toPrefetchStats(st prefetch.Stats) *pb.PrefetchStats {
	return &pb.PrefetchStats{
		WaitStorageNs: st.WaitStorage.Nanoseconds(), WaitCacheNs: st.WaitCache.Nanoseconds(),
		WaitRingNs: st.WaitRing.Nanoseconds(), WaitWorkNs: st.WaitWork.Nanoseconds(),
		CacheHits: st.CacheHits, CacheMisses: st.CacheMisses, CorruptSkipped: st.CorruptSkipped,
		Padded: st.Padded,
	}
}
