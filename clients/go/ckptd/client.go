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
	pf     pb.PrefetchClient

	mu      sync.Mutex
	mapping *arena.Mapping
	retired []*arena.Mapping // old mappings; slices of them may still be in use
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
	return &Client{socket: socket, conn: conn, api: pb.NewCheckpointClient(conn), pf: pb.NewPrefetchClient(conn)}, nil
}

// Close closes the connection and unmaps the arena.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, m := range append(c.retired, c.mapping) {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	c.mapping, c.retired = nil, nil
	return errors.Join(append(errs, c.conn.Close())...)
}

// API exposes the raw gRPC client, for tests of the protocol itself.
func (c *Client) API() pb.CheckpointClient { return c.api }

// region returns a lease's bytes in the client's mapping of the arena. The
// arena is mapped once and kept (mapping per save would pay page faults on
// every save), and mapped again only when the lease names another arena
// file: a daemon restarted after a clean exit makes a new one, and bytes
// copied into the old mapping would never reach it.
func (c *Client) region(ctx context.Context, l *pb.Lease) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mapping == nil || c.mapping.ID() != l.GetArenaId() {
		if err := c.remap(ctx); err != nil {
			return nil, err
		}
	}
	mem := c.mapping.Bytes()
	off, n := l.GetOffset(), l.GetLength()
	if off > uint64(len(mem)) || n > uint64(len(mem))-off {
		return nil, fmt.Errorf("ckptd at %s: lease [%d, +%d) outside the %d-byte arena", c.socket, off, n, len(mem))
	}
	return mem[off : off+n : off+n], nil
}

// remap maps the arena the daemon names now. Call with mu held.
func (c *Client) remap(ctx context.Context) error {
	info, err := c.api.GetArena(ctx, &pb.GetArenaRequest{})
	if err != nil {
		return c.wrap(err)
	}
	m, err := arena.Map(info.GetPath(), int64(info.GetSize()))
	if err != nil {
		return err
	}
	if c.mapping != nil {
		c.retired = append(c.retired, c.mapping)
	}
	c.mapping = m
	return nil
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
