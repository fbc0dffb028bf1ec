package ckptd

import (
	"context"
	"errors"
	"io"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// LoadRequest names a shard to restore.
type LoadRequest struct {
	Job    string
	Step   int64
	Latest bool
	Rank   int
}

// Shard is a restored shard. Tensor data is copied out of the arena, so it
// stays valid after the region is released.
type Shard struct {
	Step      int64
	WorldSize int
	Tensors   []Tensor
	Metadata  []byte
}

func (r *LoadRequest) pb() *pb.BeginRestoreRequest {
	return &pb.BeginRestoreRequest{Job: r.Job, Step: r.Step, Latest: r.Latest, Rank: int32(r.Rank)}
}

// Load restores one rank's shard through the arena.
func (c *Client) Load(ctx context.Context, req *LoadRequest) (*Shard, error) {
	resp, err := c.api.BeginRestore(ctx, req.pb())
	if err != nil {
		return nil, c.wrap(err)
	}
	lease := resp.GetLease()
	defer func() {
		_, _ = c.api.ReleaseRegion(context.WithoutCancel(ctx), &pb.ReleaseRegionRequest{LeaseId: lease.GetId()})
	}()
	region, err := c.region(ctx, lease)
	if err != nil {
		return nil, err
	}
	return shardFrom(resp.GetHeader(), region), nil
}

// LoadStream restores one rank's shard over gRPC instead of shared memory.
func (c *Client) LoadStream(ctx context.Context, req *LoadRequest) (*Shard, error) {
	stream, err := c.api.RestoreStream(ctx, req.pb())
	if err != nil {
		return nil, c.wrap(err)
	}
	first, err := stream.Recv()
	if err != nil {
		return nil, c.wrap(err)
	}
	h := first.GetHeader()
	if h == nil {
		return nil, c.wrap(errors.New("RestoreStream: first message is not a header"))
	}
	data := make([]byte, 0, h.GetSize())
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, c.wrap(err)
		}
		data = append(data, msg.GetData()...)
	}
	if uint64(len(data)) != h.GetSize() {
		return nil, c.wrap(errors.New("RestoreStream: short stream"))
	}
	return shardFrom(h, data), nil
}

func shardFrom(h *pb.RestoreHeader, region []byte) *Shard {
	s := &Shard{Step: h.GetStep(), WorldSize: int(h.GetWorldSize()), Metadata: h.GetMetadata()}
	for _, t := range h.GetTensors() {
		data := make([]byte, t.GetLength())
		copy(data, region[t.GetOffset():t.GetOffset()+t.GetLength()])
		s.Tensors = append(s.Tensors, Tensor{Name: t.GetName(), DType: t.GetDtype(), Shape: t.GetShape(), Data: data})
	}
	return s
}
