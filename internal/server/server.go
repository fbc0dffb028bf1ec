// Package server adapts the checkpoint core to the gRPC API in proto/: it
// converts messages, calls staging.Manager, and maps errors to gRPC
// status codes with errors.Is. It holds no logic of its own.
package server

import (
	"context"
	"errors"
	"io"
	"math"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Checkpoint implements pb.CheckpointServer.
type Checkpoint struct {
	pb.UnimplementedCheckpointServer
	mgr   *staging.Manager
	arena *arena.Arena
	hot   *arena.Pool
}

// Register adds the checkpoint service for mgr to s; a is mgr's arena
// (CheckpointArena(a)), which clients map, and hot, when not nil, its
// hot tier's memory (ManagerConfig.HotMapping), which they may map too.
func Register(s grpc.ServiceRegistrar, mgr *staging.Manager, a *arena.Arena, hot *arena.Pool) {
	pb.RegisterCheckpointServer(s, &Checkpoint{mgr: mgr, arena: a, hot: hot})
}

func (s *Checkpoint) GetArena(context.Context, *pb.GetArenaRequest) (*pb.ArenaInfo, error) {
	a := s.arena
	info := &pb.ArenaInfo{Path: a.Path(), Size: uint64(a.Size()), Locked: a.Locked(), DefaultJob: s.mgr.DefaultJob(), Id: a.ID()}
	if s.hot != nil {
		info.Hot = &pb.MappedFile{Path: s.hot.Path(), Size: uint64(s.hot.Size()), Id: s.hot.ID()}
	}
	return info, nil
}

func (s *Checkpoint) BeginSave(ctx context.Context, req *pb.BeginSaveRequest) (*pb.BeginSaveResponse, error) {
	lease, err := s.mgr.BeginSave(ctx, owner(ctx), fromTarget(req.GetTarget()), fromTensors(req.GetTensors()))
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &pb.BeginSaveResponse{Lease: s.toLease(lease)}
	resp.CopyCheck = toCopyCheck(lease.Check)
	return resp, nil
}

func (s *Checkpoint) CommitSave(ctx context.Context, req *pb.CommitSaveRequest) (*pb.CommitSaveResponse, error) {
	t, n, err := s.mgr.CommitSave(owner(ctx), req.GetLeaseId(), req.GetMetadata(), req.GetChunkHashes())
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.CommitSaveResponse{Target: toTarget(t), Bytes: uint64(n)}, nil
}

func (s *Checkpoint) AbortSave(ctx context.Context, req *pb.AbortSaveRequest) (*pb.AbortSaveResponse, error) {
	return &pb.AbortSaveResponse{}, toStatus(s.mgr.AbortSave(owner(ctx), req.GetLeaseId()))
}

func (s *Checkpoint) SaveStream(stream grpc.ClientStreamingServer[pb.SaveStreamRequest, pb.CommitSaveResponse]) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h := first.GetHeader()
	if h == nil {
		return status.Error(codes.InvalidArgument, "SaveStream: the first message must be a header")
	}
	r := &streamReader{recv: stream.Recv}
	ctx := stream.Context()
	t, n, err := s.mgr.SaveFrom(ctx, owner(ctx), fromTarget(h.GetTarget()), fromTensors(h.GetTensors()), h.GetMetadata(), r)
	if err != nil {
		return toStatus(err)
	}
	return stream.SendAndClose(&pb.CommitSaveResponse{Target: toTarget(t), Bytes: uint64(n)})
}

// streamReader turns SaveStream's data messages into an io.Reader.
type streamReader struct {
	recv func() (*pb.SaveStreamRequest, error)
	buf  []byte
}

func (r *streamReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		msg, err := r.recv()
		if err != nil {
			return 0, err // io.EOF at the end of the stream
		}
		if msg.GetHeader() != nil {
			return 0, status.Error(codes.InvalidArgument, "SaveStream: a second header")
		}
		r.buf = msg.GetData()
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

func (s *Checkpoint) WaitSave(ctx context.Context, req *pb.WaitSaveRequest) (*pb.WaitSaveResponse, error) {
	wait := s.mgr.Wait
	if req.GetNowait() {
		wait = s.mgr.Status
	}
	res, err := wait(ctx, req.GetJob(), req.GetStep(), int(req.GetRank()), req.GetAttempt())
	if err != nil && res.State == staging.StateUnknown {
		return nil, toStatus(err)
	}
	if err != nil {
		msg := "save is " + res.State.String()
		if res.Err != nil {
			msg += "; last error: " + res.Err.Error()
		}
		code, reason := codes.DeadlineExceeded, pb.ErrorReason_DEADLINE
		if errors.Is(err, context.Canceled) {
			code, reason = codes.Canceled, pb.ErrorReason_CANCELLED
		}
		return nil, withInfo(code, msg, reason, map[string]string{"state": res.State.String()})
	}
	resp := &pb.WaitSaveResponse{State: toState(res.State)}
	if res.Err != nil {
		resp.Error = res.Err.Error()
		// A failed save says why the way a failed call does, so that a
		// save refused late (another run committed its step after this
		// one was accepted) reads like one refused at BeginSave.
		if _, reason, meta := classify(res.Err); reason != pb.ErrorReason_INTERNAL && res.State == staging.StateFailed {
			resp.Reason, resp.Metadata = reason.String(), meta
		}
		if res.State == staging.StateHot {
			resp.ReplicationError = res.Err.Error() // it reached no peer: see staging.StateHot
		}
	}
	return resp, nil
}

func (s *Checkpoint) ListSteps(ctx context.Context, req *pb.ListStepsRequest) (*pb.ListStepsResponse, error) {
	if req.GetTiers() {
		return s.listTiers(ctx, req.GetJob())
	}
	recs, err := s.mgr.Steps(ctx, req.GetJob())
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &pb.ListStepsResponse{}
	for _, r := range recs {
		resp.Steps = append(resp.Steps, &pb.StepInfo{
			Step: r.Step, WorldSize: int32(r.WorldSize), Bytes: uint64(r.Bytes),
			StoredBytes: uint64(r.StoredBytes), CommittedUnixNano: r.CommittedAt.UnixNano(), Attempt: r.Attempt,
		})
	}
	return resp, nil
}

// listTiers answers ListSteps with tiers: committed steps and those kept
// in memory only, each with where it can be restored from.
func (s *Checkpoint) listTiers(ctx context.Context, job string) (*pb.ListStepsResponse, error) {
	steps, err := s.mgr.Tiers(ctx, job)
	if err != nil {
		return nil, toStatus(err)
	}
	resp := &pb.ListStepsResponse{}
	for _, st := range steps {
		info := &pb.StepInfo{Step: st.Step, WorldSize: int32(st.WorldSize), Attempt: st.Attempt, Tiers: st.Tiers,
			MemoryOnly: st.MemoryOnly, RanksHeld: int32(st.RanksHeld)}
		if r := st.Commit; r != nil {
			info.Bytes, info.StoredBytes, info.CommittedUnixNano = uint64(r.Bytes), uint64(r.StoredBytes), r.CommittedAt.UnixNano()
		}
		resp.Steps = append(resp.Steps, info)
	}
	return resp, nil
}

func (s *Checkpoint) BeginRestore(ctx context.Context, req *pb.BeginRestoreRequest) (*pb.BeginRestoreResponse, error) {
	lease, h, err := s.mgr.BeginRestore(ctx, owner(ctx), fromRestoreRequest(req))
	if err != nil {
		return nil, toStatus(err)
	}
	return &pb.BeginRestoreResponse{Lease: s.toLease(lease), Header: toHeader(h)}, nil
}

func (s *Checkpoint) RestoreStream(req *pb.BeginRestoreRequest, stream grpc.ServerStreamingServer[pb.RestoreStreamResponse]) error {
	ctx := stream.Context()
	o := owner(ctx)
	r := fromRestoreRequest(req)
	r.InPlace = false // the bytes go on the wire: only those asked for
	lease, h, err := s.mgr.BeginRestore(ctx, o, r)
	if err != nil {
		return toStatus(err)
	}
	defer func() { _ = s.mgr.Release(o, lease.ID) }()
	if err := stream.Send(&pb.RestoreStreamResponse{Msg: &pb.RestoreStreamResponse_Header{Header: toHeader(h)}}); err != nil {
		return err
	}
	data, err := s.mgr.Bytes(o, lease.ID)
	if err != nil {
		return toStatus(err)
	}
	for len(data) > 0 {
		n := min(len(data), pb.StreamChunkBytes)
		if err := stream.Send(&pb.RestoreStreamResponse{Msg: &pb.RestoreStreamResponse_Data{Data: data[:n]}}); err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

func (s *Checkpoint) ReleaseRegion(ctx context.Context, req *pb.ReleaseRegionRequest) (*pb.ReleaseRegionResponse, error) {
	return &pb.ReleaseRegionResponse{}, toStatus(s.mgr.Release(owner(ctx), req.GetLeaseId()))
}

var _ io.Reader = (*streamReader)(nil)

func fromRestoreRequest(r *pb.BeginRestoreRequest) staging.RestoreRequest {
	var slices []checkpoint.Slice
	for _, sl := range r.GetSlices() {
		slices = append(slices, checkpoint.Slice{Name: sl.GetName(), Offset: clampInt64(sl.GetOffset()), Length: clampInt64(sl.GetLength())})
	}
	return staging.RestoreRequest{Job: r.GetJob(), Step: r.GetStep(), Latest: r.GetLatest(), Rank: int(r.GetRank()), Tensors: r.GetTensors(),
		Finite: r.GetFinite(), Slices: slices, HeaderOnly: r.GetHeaderOnly(), InPlace: r.GetInPlace()}
}

func fromTarget(t *pb.SaveTarget) checkpoint.Target {
	return checkpoint.Target{Job: t.GetJob(), Step: t.GetStep(), Rank: int(t.GetRank()), WorldSize: int(t.GetWorldSize()), Attempt: t.GetAttempt()}
}

func toTarget(t checkpoint.Target) *pb.SaveTarget {
	return &pb.SaveTarget{Job: t.Job, Step: t.Step, Rank: int32(t.Rank), WorldSize: int32(t.WorldSize), Attempt: t.Attempt}
}

// fromTensors converts a request's table; offsets beyond int64 become -1
// so that validation rejects them instead of wrapping around.
func fromTensors(ts []*pb.Tensor) []checkpoint.Tensor {
	out := make([]checkpoint.Tensor, len(ts))
	for i, t := range ts {
		out[i] = checkpoint.Tensor{
			Name: t.GetName(), DType: dtype.DType(t.GetDtype()), Shape: t.GetShape(),
			Offset: clampInt64(t.GetOffset()), Length: clampInt64(t.GetLength()),
		}
	}
	return out
}

func clampInt64(v uint64) int64 {
	if v > math.MaxInt64 {
		return -1
	}
	return int64(v)
}

func toTensors(ts []checkpoint.Tensor) []*pb.Tensor {
	out := make([]*pb.Tensor, len(ts))
	for i, t := range ts {
		out[i] = &pb.Tensor{Name: t.Name, Dtype: string(t.DType), Shape: t.Shape, Offset: uint64(t.Offset), Length: uint64(t.Length)}
	}
	return out
}

func (s *Checkpoint) toLease(l staging.LeaseInfo) *pb.Lease {
	id := l.ArenaID
	if id == "" {
		id = s.arena.ID()
	}
	return &pb.Lease{Id: l.ID, Offset: uint64(l.Offset), Length: uint64(l.Length), ArenaId: id}
}

func toHeader(h *staging.RestoreHeader) *pb.RestoreHeader {
	return &pb.RestoreHeader{Step: h.Step, WorldSize: int32(h.WorldSize), Attempt: h.Attempt, Tensors: toTensors(h.Tensors), Metadata: h.Metadata, Size: uint64(h.Size),
		Tier: h.Tier, SkippedStep: h.SkippedStep, SkippedNonfinite: h.SkippedNonFinite, CopyCheck: toCopyCheck(h.Check), InPlace: h.InPlace}
}

// toCopyCheck is c on the wire (nil for none).
func toCopyCheck(c *checkpoint.CopyCheck) *pb.CopyCheck {
	if c == nil {
		return nil
	}
	out := &pb.CopyCheck{ChunkEnds: make([]uint64, len(c.Ends)), ChunkHashes: c.Hashes, Key: c.Key}
	for i, e := range c.Ends {
		out.ChunkEnds[i] = uint64(e)
	}
	return out
}

func toState(s staging.State) pb.SaveState {
	switch s {
	case staging.StateStaging, staging.StateStaged:
		return pb.SaveState_SAVE_STATE_STAGED
	case staging.StateDraining:
		return pb.SaveState_SAVE_STATE_DRAINING
	case staging.StateDurable:
		return pb.SaveState_SAVE_STATE_DURABLE
	case staging.StateHot:
		return pb.SaveState_SAVE_STATE_HOT
	case staging.StateReplicated:
		return pb.SaveState_SAVE_STATE_REPLICATED
	case staging.StateCommitted:
		return pb.SaveState_SAVE_STATE_COMMITTED
	case staging.StateFailed:
		return pb.SaveState_SAVE_STATE_FAILED
	}
	return pb.SaveState_SAVE_STATE_UNSPECIFIED
}
