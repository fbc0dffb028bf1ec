// Package ckptd is the Go client of the ckptd sidecar. It connects to
// `ckptd serve` over its unix socket, maps the staging arena once, and
// saves and loads checkpoint shards through it; SaveStream and LoadStream
// carry the bytes over gRPC instead, for callers that cannot map the arena.
package ckptd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/ckptd/ckptd/internal/arena"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// DefaultSocket is the socket used when none is given and CKPTD_SOCKET is
// unset; it matches `ckptd serve`'s default.
func DefaultSocket() string {
	if s := os.Getenv("CKPTD_SOCKET"); s != "" {
		return s
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("ckptd-%d.sock", os.Getuid()))
}

// Client talks to one daemon. It is safe for concurrent use.
type Client struct {
	socket string
	conn   *grpc.ClientConn
	api    pb.CheckpointClient

	mapOnce sync.Once
	mapping *arena.Mapping
	mapErr  error
}

// Dial connects to the daemon on socket ("" for DefaultSocket). The
// connection is lazy; the first call fails if no daemon listens.
func Dial(socket string) (*Client, error) {
	if socket == "" {
		socket = DefaultSocket()
	}
	if abs, err := filepath.Abs(socket); err == nil {
		socket = abs
	}
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		return nil, fmt.Errorf("ckptd socket %s: %w", socket, err)
	}
	return &Client{socket: socket, conn: conn, api: pb.NewCheckpointClient(conn)}, nil
}

// Close closes the connection and unmaps the arena.
func (c *Client) Close() error {
	var err error
	if c.mapping != nil {
		err = c.mapping.Close()
	}
	return errors.Join(err, c.conn.Close())
}

// API exposes the raw gRPC client, for tests of the protocol itself.
func (c *Client) API() pb.CheckpointClient { return c.api }

// arena maps the daemon's staging arena on first use and keeps the mapping:
// mapping per save would pay page faults on every save.
func (c *Client) arena(ctx context.Context) ([]byte, error) {
	c.mapOnce.Do(func() {
		info, err := c.api.GetArena(ctx, &pb.GetArenaRequest{})
		if err != nil {
			c.mapErr = c.wrap(err)
			return
		}
		c.mapping, c.mapErr = arena.Map(info.GetPath(), int64(info.GetSize()))
	})
	if c.mapErr != nil {
		return nil, c.mapErr
	}
	return c.mapping.Bytes(), nil
}

// wrap adds the socket to errors so an unreachable daemon is obvious.
func (c *Client) wrap(err error) error {
	return fmt.Errorf("ckptd at %s: %w", c.socket, err)
}

// StepInfo describes a committed step.
type StepInfo struct {
	Step        int64
	WorldSize   int
	Bytes       int64
	StoredBytes int64
}

// Steps lists the committed steps of job ("" for the daemon's default).
func (c *Client) Steps(ctx context.Context, job string) ([]StepInfo, error) {
	resp, err := c.api.ListSteps(ctx, &pb.ListStepsRequest{Job: job})
	if err != nil {
		return nil, c.wrap(err)
	}
	out := make([]StepInfo, len(resp.GetSteps()))
	for i, s := range resp.GetSteps() {
		out[i] = StepInfo{s.GetStep(), int(s.GetWorldSize()), int64(s.GetBytes()), int64(s.GetStoredBytes())}
	}
	return out, nil
}
