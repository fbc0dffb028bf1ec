//go:build linux

package ckptd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/zeebo/blake3"

	"github.com/ckptd/ckptd/checkpoint/attempt"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Tensor is one named tensor: dtype in safetensors spelling (F32, BF16,
// ...), shape, and its bytes in row-major order.
type Tensor struct {
	Name  string
	DType string
	Shape []int64
	Data  []byte
}

// SaveRequest is one rank's shard of one step.
type SaveRequest struct {
	Job       string // "" for the daemon's default
	Step      int64
	Rank      int
	WorldSize int
	Tensors   []Tensor
	Metadata  []byte
	Attempt   string // "" for the client's (see WithAttempt)
}

// SaveHandle refers to an accepted save.
type SaveHandle struct {
	c       *Client
	job     string
	step    int64
	rank    int
	attempt string
}

// target is the request's save target; its attempt is checked here, so a
// bad one fails before anything is sent.
func (c *Client) target(r *SaveRequest) (*pb.SaveTarget, error) {
	a := r.Attempt
	if a == "" {
		a = c.attempt
	}
	if err := attempt.Check(a); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return &pb.SaveTarget{Job: r.Job, Step: r.Step, Rank: int32(r.Rank), WorldSize: int32(r.WorldSize), Attempt: a}, nil
}

// table lays the tensors out back to back, which lets the daemon compress
// each chunk in place.
func (r *SaveRequest) table() []*pb.Tensor {
	out := make([]*pb.Tensor, len(r.Tensors))
	var off uint64
	for i, t := range r.Tensors {
		out[i] = &pb.Tensor{Name: t.Name, Dtype: t.DType, Shape: t.Shape, Offset: off, Length: uint64(len(t.Data))}
		off += uint64(len(t.Data))
	}
	return out
}

// Save copies the shard into the staging arena and returns once the daemon
// has accepted it; the data becomes durable in the background (Wait).
func (c *Client) Save(ctx context.Context, req *SaveRequest) (*SaveHandle, error) {
	return retryMoved(func() (*SaveHandle, error) { return c.save(ctx, req) })
}

func (c *Client) save(ctx context.Context, req *SaveRequest) (*SaveHandle, error) {
	table := req.table()
	target, err := c.target(req)
	if err != nil {
		return nil, err
	}
	resp, err := c.api.BeginSave(ctx, &pb.BeginSaveRequest{Target: target, Tensors: table})
	if err != nil {
		return nil, c.wrap(err)
	}
	lease := resp.GetLease()
	region, err := c.region(ctx, lease)
	if err != nil {
		_, _ = c.api.AbortSave(context.WithoutCancel(ctx), &pb.AbortSaveRequest{LeaseId: lease.GetId()})
		return nil, err
	}
	for i, t := range req.Tensors {
		copy(region[table[i].Offset:], t.Data)
	}
	commit := &pb.CommitSaveRequest{LeaseId: lease.GetId(), Metadata: req.Metadata}
	if check := resp.GetCopyCheck(); check != nil {
		commit.ChunkHashes, err = copyHashes(req.Tensors, check)
	}
	var cr *pb.CommitSaveResponse
	if err == nil {
		cr, err = c.api.CommitSave(ctx, commit)
		err = c.wrapIf(err)
	}
	if err != nil {
		_, _ = c.api.AbortSave(context.WithoutCancel(ctx), &pb.AbortSaveRequest{LeaseId: lease.GetId()})
		return nil, err
	}
	return c.handle(cr.GetTarget()), nil
}

// wrapIf is wrap for an error that may be nil.
func (c *Client) wrapIf(err error) error {
	if err == nil {
		return nil
	}
	return c.wrap(err)
}

// copyHashes answers a daemon that shares its arena with other users
// (CopyCheck in the proto): the MAC of each chunk of the data space that
// the check cuts, taken from the caller's tensors, never from the shared
// region that others could rewrite meanwhile.
func copyHashes(ts []Tensor, check *pb.CopyCheck) ([]uint64, error) {
	ends := check.GetChunkEnds()
	out := make([]uint64, 0, len(ends))
	h, err := newMAC(check.GetKey())
	if err != nil {
		return nil, err
	}
	var pos uint64 // data-space offset of ts[i].Data[j]
	i, j := 0, 0
	for _, end := range ends {
		for pos < end {
			for i < len(ts) && j == len(ts[i].Data) {
				i, j = i+1, 0
			}
			if i == len(ts) {
				return nil, fmt.Errorf("%w: the daemon's copy check covers %d bytes, more than the save's", ErrInvalid, end)
			}
			n := min(uint64(len(ts[i].Data)-j), end-pos)
			_, _ = h.Write(ts[i].Data[j : j+int(n)])
			j, pos = j+int(n), pos+n
		}
		out = append(out, macSum(h))
		h.Reset()
	}
	for ; i < len(ts); i, j = i+1, 0 {
		if j < len(ts[i].Data) {
			return nil, fmt.Errorf("%w: the daemon's copy check covers %d bytes, less than the save's", ErrInvalid, pos)
		}
	}
	return out, nil
}

// newMAC is the check's MAC (see CopyCheck in the proto): BLAKE3 keyed
// with the lease's key.
func newMAC(key []byte) (*blake3.Hasher, error) {
	h, err := blake3.NewKeyed(key)
	if err != nil {
		return nil, fmt.Errorf("%w: the daemon's copy check has a key of %d bytes", ErrInvalid, len(key))
	}
	return h, nil
}

// macSum is the first 8 bytes of h's output, little-endian.
func macSum(h *blake3.Hasher) uint64 {
	var b [8]byte
	_, _ = h.Digest().Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

func (c *Client) handle(t *pb.SaveTarget) *SaveHandle {
	return &SaveHandle{c: c, job: t.GetJob(), step: t.GetStep(), rank: int(t.GetRank()), attempt: t.GetAttempt()}
}

// SaveStream sends the shard over gRPC instead of shared memory.
func (c *Client) SaveStream(ctx context.Context, req *SaveRequest) (*SaveHandle, error) {
	target, err := c.target(req)
	if err != nil {
		return nil, err
	}
	stream, err := c.api.SaveStream(ctx)
	if err != nil {
		return nil, c.wrap(err)
	}
	hdr := &pb.SaveStreamHeader{Target: target, Tensors: req.table(), Metadata: req.Metadata}
	if err := stream.Send(&pb.SaveStreamRequest{Msg: &pb.SaveStreamRequest_Header{Header: hdr}}); err != nil {
		return nil, c.closeStream(stream, err)
	}
	for _, t := range req.Tensors {
		for d := t.Data; len(d) > 0; {
			n := min(len(d), pb.StreamChunkBytes)
			if err := stream.Send(&pb.SaveStreamRequest{Msg: &pb.SaveStreamRequest_Data{Data: d[:n]}}); err != nil {
				return nil, c.closeStream(stream, err)
			}
			d = d[n:]
		}
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return nil, c.wrap(err)
	}
	return c.handle(resp.GetTarget()), nil
}

// closeStream reports the server's error rather than a bare io.EOF when a
// send fails because the server already answered.
func (c *Client) closeStream(stream interface {
	CloseAndRecv() (*pb.CommitSaveResponse, error)
}, err error) error {
	if _, rerr := stream.CloseAndRecv(); rerr != nil {
		return c.wrap(rerr)
	}
	return c.wrap(err)
}

// ErrSaveFailed is matched by the error Wait returns when the daemon gave
// up on a save (a *SaveFailure).
var ErrSaveFailed = errors.New("save failed")

// SaveFailure is a save the daemon gave up on. It matches ErrSaveFailed
// and, when the daemon said why, the sentinel of that reason: a save
// refused because another run of the job committed its step after this
// one was accepted matches ErrStepCommitted, with the committing attempt
// in Metadata["attempt"], as a save refused at once does.
type SaveFailure struct {
	Step     int64
	Rank     int
	State    pb.SaveState
	Message  string
	Reason   string            // the ErrorInfo reason, "" from daemons that send none
	Metadata map[string]string // the ErrorInfo fields (job, step, attempt, ...)
}

func (e *SaveFailure) Error() string {
	return fmt.Sprintf("%s: step %d rank %d: %s: %s", ErrSaveFailed, e.Step, e.Rank, e.State, e.Message)
}

func (e *SaveFailure) Is(target error) bool {
	return target == ErrSaveFailed || (e.Reason != "" && reasonErr(e.Reason) == target)
}

// ErrNotReplicated is what Wait's error matches when a save of a step
// the daemon keeps in memory only reached this node's memory but not its
// --replicas peers (a *NotReplicatedError says why): the save stands
// (Status says HOT), and is lost with the node.
var ErrNotReplicated = errors.New("not replicated to peers")

// NotReplicatedError is a save kept in this node's memory only, which
// the daemon could not send to its peers. It matches ErrNotReplicated.
type NotReplicatedError struct {
	Step    int64
	Rank    int
	Message string // why, as the daemon says
}

func (e *NotReplicatedError) Error() string {
	return fmt.Sprintf("%s: step %d rank %d is in this node's memory only, and lost with it: %s", ErrNotReplicated, e.Step, e.Rank, e.Message)
}

func (e *NotReplicatedError) Is(target error) bool { return target == ErrNotReplicated }

// Wait blocks until the save reached where it ends, the save failed, or
// ctx ends. A save ends committed, or, for a step the daemon keeps in
// memory only (ckptd serve --persist-every), hot or replicated: Status
// tells which. A save kept in memory that did not reach its peers returns
// a *NotReplicatedError (matching ErrNotReplicated): not a failure of the
// save, but a warning that one node holds it.
func (h *SaveHandle) Wait(ctx context.Context) error {
	resp, err := h.c.api.WaitSave(ctx, &pb.WaitSaveRequest{Job: h.job, Step: h.step, Rank: int32(h.rank), Attempt: h.attempt})
	if err != nil {
		return h.c.wrap(err)
	}
	switch resp.GetState() {
	case pb.SaveState_SAVE_STATE_HOT:
		if why := resp.GetReplicationError(); why != "" {
			return &NotReplicatedError{Step: h.step, Rank: h.rank, Message: why}
		}
	case pb.SaveState_SAVE_STATE_COMMITTED, pb.SaveState_SAVE_STATE_REPLICATED:
	default:
		return &SaveFailure{Step: h.step, Rank: h.rank, State: resp.GetState(), Message: resp.GetError(),
			Reason: resp.GetReason(), Metadata: resp.GetMetadata()}
	}
	return nil
}

// Status returns the save's state now, without waiting.
func (h *SaveHandle) Status(ctx context.Context) (pb.SaveState, error) {
	resp, err := h.c.api.WaitSave(ctx, &pb.WaitSaveRequest{Job: h.job, Step: h.step, Rank: int32(h.rank), Attempt: h.attempt, Nowait: true})
	if err != nil {
		return pb.SaveState_SAVE_STATE_UNSPECIFIED, h.c.wrap(err)
	}
	return resp.GetState(), nil
}

// Step is the handle's step.
func (h *SaveHandle) Step() int64 { return h.step }

// Handle returns a handle for a save made earlier by this client's
// attempt, possibly by another process or before a daemon restart, so
// that it can be waited on.
func (c *Client) Handle(job string, step int64, rank int) *SaveHandle {
	return &SaveHandle{c: c, job: job, step: step, rank: rank, attempt: c.attempt}
}
