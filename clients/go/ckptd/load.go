//go:build linux

package ckptd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// LoadRequest names a shard to restore.
type LoadRequest struct {
	Job    string
	Step   int64
	Latest bool
	Rank   int
	// Tensors, when not empty, loads only these tensors (only their chunks
	// are read).
	Tensors []string
	// Finite, with Latest, loads the newest committed step whose tensors
	// hold no NaN or Inf.
	Finite bool
}

// Shard is a restored shard. Tensor data is copied out of the daemon's
// shared memory (the arena, or the hot tier's file), so it stays valid
// after the region is released.
type Shard struct {
	Step      int64
	WorldSize int
	Attempt   string
	// Tier is where the daemon found the bytes: "hot", "peer" or
	// "storage".
	Tier string
	// SkippedStep, for Latest, is a newer step the daemon kept in memory
	// only and could not restore whole (nodes holding some of its ranks
	// were lost); 0 when none.
	SkippedStep int64
	// SkippedNonFinite, for Latest with Finite, are the newer committed
	// steps passed over for holding NaN or Inf, newest first.
	SkippedNonFinite []int64
	Tensors          []Tensor
	Metadata         []byte
}

func (r *LoadRequest) pb() *pb.BeginRestoreRequest {
	return &pb.BeginRestoreRequest{Job: r.Job, Step: r.Step, Latest: r.Latest, Rank: int32(r.Rank), Tensors: r.Tensors, Finite: r.Finite}
}

// Load restores one rank's shard: from the daemon's hot tier where it
// lies there (its file mapped read-only), else through the arena. A hot
// tier file this client cannot map makes it copy through the arena.
func (c *Client) Load(ctx context.Context, req *LoadRequest) (*Shard, error) {
	return retryMoved(func() (*Shard, error) {
		s, err := c.load(ctx, req, c.canReadInPlace(ctx))
		if errors.Is(err, errNotInPlace) {
			return c.load(ctx, req, false)
		}
		return s, err
	})
}

func (c *Client) load(ctx context.Context, req *LoadRequest, inPlace bool) (*Shard, error) {
	r := req.pb()
	r.InPlace = inPlace
	resp, err := c.api.BeginRestore(ctx, r)
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
	h := resp.GetHeader()
	if h.GetCopyCheck() != nil {
		// Others can write the arena: use a copy that is ours alone, once
		// it hashes as the daemon says.
		if h.GetSize() > uint64(len(region)) {
			return nil, fmt.Errorf("%w: a %d-byte restore in a %d-byte region", ErrCorrupt, h.GetSize(), len(region))
		}
		region = bytes.Clone(region[:h.GetSize()])
		if err := checkRestored(h.GetCopyCheck(), region); err != nil {
			return nil, err
		}
	}
	return shardFrom(h, region)
}

// checkRestored checks a private copy of a restore against the header's
// CopyCheck: whole chunks, their ends in data and their hashes.
func checkRestored(check *pb.CopyCheck, data []byte) error {
	ends, want := check.GetChunkEnds(), check.GetChunkHashes()
	if len(ends) != len(want) || len(ends) > 0 && ends[len(ends)-1] != uint64(len(data)) || len(ends) == 0 && len(data) > 0 {
		return fmt.Errorf("%w: the daemon's copy check does not cover the %d restored bytes", ErrCorrupt, len(data))
	}
	h, err := newMAC(check.GetKey())
	if err != nil {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	var start uint64
	for i, end := range ends {
		if end >= start && end <= uint64(len(data)) {
			h.Reset()
			_, _ = h.Write(data[start:end])
		}
		if end < start || end > uint64(len(data)) || macSum(h) != want[i] {
			return fmt.Errorf("%w: chunk %d of the restored bytes changed in the daemon's shared arena before this client "+
				"copied it out (a member of its --socket-group?); nothing was loaded", ErrCorrupt, i)
		}
		start = end
	}
	return nil
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
	// The announced size sizes the buffer only up to a bound: a header is
	// no reason to allocate without limit.
	data := make([]byte, 0, min(h.GetSize(), 64<<20))
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, c.wrap(err)
		}
		if uint64(len(data))+uint64(len(msg.GetData())) > h.GetSize() {
			return nil, c.wrap(fmt.Errorf("RestoreStream: more bytes than the %d announced", h.GetSize()))
		}
		data = append(data, msg.GetData()...)
	}
	if uint64(len(data)) != h.GetSize() {
		return nil, c.wrap(errors.New("RestoreStream: short stream"))
	}
	if h.GetCopyCheck() != nil { // the daemon streamed them out of its shared arena
		if err := checkRestored(h.GetCopyCheck(), data); err != nil {
			return nil, err
		}
	}
	return shardFrom(h, data)
}

// shardFrom copies the tensors out of a restored region, refusing a
// header whose tensors lie outside it: the header comes from the daemon,
// and a crafted one must be an error, not a panic or a huge allocation.
func shardFrom(h *pb.RestoreHeader, region []byte) (*Shard, error) {
	s := &Shard{Step: h.GetStep(), WorldSize: int(h.GetWorldSize()), Attempt: h.GetAttempt(), Metadata: h.GetMetadata(),
		Tier: h.GetTier(), SkippedStep: h.GetSkippedStep(), SkippedNonFinite: h.GetSkippedNonfinite()}
	size := uint64(len(region))
	for _, t := range h.GetTensors() {
		off, n := t.GetOffset(), t.GetLength()
		if off > size || n > size-off {
			return nil, fmt.Errorf("ckptd: restored tensor %q [%d, +%d) lies outside the %d-byte region", t.GetName(), off, n, size)
		}
		data := make([]byte, n)
		copy(data, region[off:off+n])
		s.Tensors = append(s.Tensors, Tensor{Name: t.GetName(), DType: t.GetDtype(), Shape: t.GetShape(), Data: data})
	}
	return s, nil
}
