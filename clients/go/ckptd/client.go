//go:build linux

// Package ckptd is the Go client of the ckptd sidecar. It connects to
// `ckptd serve` over its unix socket, maps the staging arena once, and
// saves and loads checkpoint shards through it; SaveStream and LoadStream
// carry the bytes over gRPC instead, for callers that cannot map the arena.
//
// It builds on Linux only: it checks the daemon's credentials with
// SO_PEERCRED and maps the arena with mmap.
package ckptd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint/attempt"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// DefaultSocket is the socket used when none is given: $CKPTD_SOCKET,
// else $XDG_RUNTIME_DIR/ckptd.sock, else /tmp/ckptd-<uid>/ckptd.sock. It
// is `ckptd serve`'s default too.
func DefaultSocket() string {
	if s := os.Getenv("CKPTD_SOCKET"); s != "" {
		return s
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "ckptd.sock")
	}
	return filepath.Join("/tmp", fmt.Sprintf("ckptd-%d", os.Getuid()), "ckptd.sock")
}

// Client talks to one daemon. It is safe for concurrent use.
type Client struct {
	socket  string
	attempt string
	dialer  *dialer
	conn    *grpc.ClientConn
	api     pb.CheckpointClient
	pf      pb.PrefetchClient

	mu      sync.Mutex
	mapping *mapping
	retired []*mapping // old mappings; slices of them may still be in use
	// The hot tier's file (ArenaInfo.hot at the last GetArena), its
	// read-only mapping once a restore in place needs it, and whether it
	// could not be mapped here (restores are then copied).
	hotInfo *pb.MappedFile
	hot     *mapping
	noHot   bool
}

// Option configures Dial.
type Option func(*Client)

// WithAttempt names the attempt (the run of the job) the client's saves
// belong to; every rank of one run must use the same one, and the next run
// another. Without it, $CKPTD_ATTEMPT, else a random id per client, which
// suits a single-process job only.
func WithAttempt(a string) Option { return func(c *Client) { c.attempt = a } }

// Dial connects to the daemon on socket ("" for DefaultSocket). The
// connection is lazy; the first call fails if no daemon listens, or if the
// socket or the daemon is not trusted (ErrUntrustedDaemon: see
// checkSocketPath).
func Dial(socket string, opts ...Option) (*Client, error) {
	if socket == "" {
		socket = DefaultSocket()
	}
	if abs, err := filepath.Abs(socket); err == nil {
		socket = abs
	}
	c := &Client{socket: socket, attempt: os.Getenv("CKPTD_ATTEMPT"), dialer: &dialer{socket: socket}}
	c.dialer.daemonUID.Store(-1)
	for _, o := range opts {
		o(c)
	}
	if c.attempt == "" {
		c.attempt = randomAttempt()
	}
	if err := attempt.Check(c.attempt); err != nil {
		return nil, fmt.Errorf("%w: the client's attempt (WithAttempt, else $CKPTD_ATTEMPT): %w", ErrInvalid, err)
	}
	conn, err := grpc.NewClient("passthrough:///ckptd",
		grpc.WithContextDialer(c.dialer.dial),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(pb.MaxMessageBytes)))
	if err != nil {
		return nil, fmt.Errorf("ckptd socket %s: %w", socket, err)
	}
	c.conn, c.api, c.pf = conn, pb.NewCheckpointClient(conn), pb.NewPrefetchClient(conn)
	return c, nil
}

func randomAttempt() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Socket is the daemon's socket.
func (c *Client) Socket() string { return c.socket }

// Attempt is the attempt the client's saves name unless a request says
// otherwise.
func (c *Client) Attempt() string { return c.attempt }

// Close closes the connection and unmaps the arena.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, m := range append(c.retired, c.mapping, c.hot) {
		if m != nil {
			errs = append(errs, m.close())
		}
	}
	c.mapping, c.retired, c.hot = nil, nil, nil
	return errors.Join(append(errs, c.conn.Close())...)
}

// API exposes the raw gRPC client, for tests of the protocol itself.
func (c *Client) API() pb.CheckpointClient { return c.api }

// region returns a lease's bytes in the client's mapping of the arena, or
// of the hot tier's file for a restore in place. The arena is mapped once
// and kept (mapping per save would pay page faults on every save), and
// mapped again only when the lease names another file: a daemon restarted
// after a clean exit makes a new one, and bytes copied into the old
// mapping would never reach it.
func (c *Client) region(ctx context.Context, l *pb.Lease) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := l.GetArenaId()
	if c.mapping == nil || c.mapping.id != id && !c.isHot(id) {
		if err := c.remap(ctx); err != nil {
			return nil, err
		}
		if c.mapping.id != id && !c.isHot(id) {
			// The daemon restarted between granting the lease and naming
			// its arena: the lease's offsets index a file no longer served,
			// and copying into the new one could overwrite someone else's
			// region. The lease died with that daemon; the caller retries.
			return nil, fmt.Errorf("ckptd at %s: %w: %w: the lease is for arena %q, the daemon now serves %q",
				c.socket, ErrDaemonUnavailable, errArenaMoved, id, c.mapping.id)
		}
	}
	m := c.mapping
	if m.id != id {
		var err error
		if m, err = c.hotMapping(); err != nil {
			return nil, err
		}
	}
	mem := m.bytes()
	off, n := l.GetOffset(), l.GetLength()
	if off > uint64(len(mem)) || n > uint64(len(mem))-off {
		return nil, fmt.Errorf("ckptd at %s: lease [%d, +%d) outside the %d-byte file %s", c.socket, off, n, len(mem), m.path)
	}
	return mem[off : off+n : off+n], nil
}

// isHot says id names the hot tier's file. Call with mu held.
func (c *Client) isHot(id string) bool { return c.hotInfo != nil && c.hotInfo.GetId() == id }

// canReadInPlace says whether to ask for restores in place: the daemon
// has a hot tier file this client has not failed to map. It maps the
// arena first if it has not yet, to learn of the file.
func (c *Client) canReadInPlace(ctx context.Context) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mapping == nil && c.remap(ctx) != nil {
		return false // the restore itself will say why
	}
	return c.hotInfo != nil && !c.noHot
}

// errNotInPlace: the hot tier's file cannot be mapped here; the restore is
// made again, copied into the arena.
var errNotInPlace = errors.New("the hot tier's file cannot be mapped here")

// hotMapping maps the hot tier's file read-only on first use, after the
// arena's checks, and checks it is the file the daemon's id names. Call
// with mu held.
func (c *Client) hotMapping() (*mapping, error) {
	info := c.hotInfo
	if c.hot != nil && c.hot.id == info.GetId() {
		return c.hot, nil
	}
	m, err := mapFile(info.GetPath(), int64(info.GetSize()), int(c.dialer.daemonUID.Load()), false)
	if errors.Is(err, ErrUntrustedDaemon) {
		return nil, c.wrap(err)
	}
	if err != nil {
		c.noHot = true
		return nil, fmt.Errorf("%w: %w", errNotInPlace, err)
	}
	if m.ident != fileOfID(info.GetId()) {
		_ = m.close()
		return nil, fmt.Errorf("ckptd at %s: %w: %w: the hot tier's file %s was made anew",
			c.socket, ErrDaemonUnavailable, errArenaMoved, info.GetPath())
	}
	m.id = info.GetId()
	if c.hot != nil {
		c.retired = append(c.retired, c.hot)
	}
	c.hot = m
	return m, nil
}

// fileOfID is the device and inode a hot tier id ("dev:ino:nonce") names;
// the nonce makes each opening's id its own.
func fileOfID(id string) string {
	parts := strings.SplitN(id, ":", 3)
	if len(parts) < 2 {
		return ""
	}
	return parts[0] + ":" + parts[1]
}

// errArenaMoved: a lease names an arena the daemon no longer serves (it
// restarted); Save and Load start over with a new lease.
var errArenaMoved = errors.New("the daemon restarted, its arena is a new one")

// arenaRetries bounds how often Save and Load start over for errArenaMoved.
const arenaRetries = 3

// retryMoved runs op again while it fails with errArenaMoved, at most
// arenaRetries times.
func retryMoved[T any](op func() (T, error)) (T, error) {
	v, err := op()
	for i := 1; i < arenaRetries && errors.Is(err, errArenaMoved); i++ {
		v, err = op()
	}
	return v, err
}

// remap maps the arena the daemon names now. Call with mu held.
func (c *Client) remap(ctx context.Context) error {
	info, err := c.api.GetArena(ctx, &pb.GetArenaRequest{})
	if err != nil {
		return c.wrap(err)
	}
	m, err := mapFile(info.GetPath(), int64(info.GetSize()), int(c.dialer.daemonUID.Load()), true)
	if err != nil {
		return c.wrap(err)
	}
	m.id = info.GetId() // leases name the opening they belong to
	c.hotInfo = info.GetHot()
	if c.mapping != nil {
		c.retired = append(c.retired, c.mapping)
	}
	c.mapping = m
	return nil
}

// wrap adds the socket to errors so an unreachable daemon is obvious, and
// reports a daemon the client refused to trust as such.
func (c *Client) wrap(err error) error {
	if status.Code(err) == codes.Unavailable {
		if r := c.dialer.refusal(); r != nil {
			return fmt.Errorf("ckptd at %s: %w", c.socket, r)
		}
	}
	if _, ok := status.FromError(err); ok {
		return &callError{socket: c.socket, err: err}
	}
	return fmt.Errorf("ckptd at %s: %w", c.socket, err)
}

// StepInfo describes a committed step.
type StepInfo struct {
	Step        int64
	WorldSize   int
	Bytes       int64
	StoredBytes int64
	Attempt     string // "" for a step written before attempts existed
}

// Steps lists the committed steps of job ("" for the daemon's default).
func (c *Client) Steps(ctx context.Context, job string) ([]StepInfo, error) {
	resp, err := c.api.ListSteps(ctx, &pb.ListStepsRequest{Job: job})
	if err != nil {
		return nil, c.wrap(err)
	}
	out := make([]StepInfo, len(resp.GetSteps()))
	for i, s := range resp.GetSteps() {
		out[i] = StepInfo{s.GetStep(), int(s.GetWorldSize()), int64(s.GetBytes()), int64(s.GetStoredBytes()), s.GetAttempt()}
	}
	return out, nil
}

// StepTiers is a step and where it can be restored from.
type StepTiers struct {
	StepInfo
	// Tiers, strongest first: "storage" (committed), "hot" (this node's
	// memory holds ranks of it), "peers" (other sidecars hold ranks of it).
	Tiers []string
	// MemoryOnly: a step kept in memory only (ckptd serve --persist-every),
	// restorable while every rank is held somewhere: RanksHeld of
	// WorldSize.
	MemoryOnly bool
	RanksHeld  int
}

// Tiers lists job's committed steps and the steps kept in memory only
// that the daemon and its peers hold, oldest first, with their tiers.
func (c *Client) Tiers(ctx context.Context, job string) ([]StepTiers, error) {
	resp, err := c.api.ListSteps(ctx, &pb.ListStepsRequest{Job: job, Tiers: true})
	if err != nil {
		return nil, c.wrap(err)
	}
	out := make([]StepTiers, len(resp.GetSteps()))
	for i, s := range resp.GetSteps() {
		out[i] = StepTiers{StepInfo{s.GetStep(), int(s.GetWorldSize()), int64(s.GetBytes()), int64(s.GetStoredBytes()), s.GetAttempt()},
			s.GetTiers(), s.GetMemoryOnly(), int(s.GetRanksHeld())}
	}
	return out, nil
}

// Status returns what the daemon is doing now (`ckptd status`): arena use,
// saves and their states, leases and their owners, dataset sessions and
// error counts, as the protocol's message.
func (c *Client) Status(ctx context.Context) (*pb.DaemonStatus, error) {
	st, err := pb.NewDaemonClient(c.conn).GetStatus(ctx, &pb.GetStatusRequest{})
	if err != nil {
		return nil, c.wrap(err)
	}
	return st, nil
}

func (c *Client) Health(ctx context.Context) error {
	resp, err := healthpb.NewHealthClient(c.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return c.wrap(err)
	}
	if s := resp.GetStatus(); s != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("ckptd at %s: %w: %s: %s", c.socket, ErrDaemonUnavailable, s, c.notServing(ctx))
	}
	return nil
}

// notServing says why a daemon is not serving: the storage it cannot
// reach, as its status names it, or that it is shutting down.
func (c *Client) notServing(ctx context.Context) string {
	st, err := c.Status(ctx)
	switch {
	case err != nil:
		return "its status does not answer either (" + err.Error() + "); see its log"
	case !st.GetStorageReady():
		return st.GetStorageError() // "storage <url> does not answer: <why>"
	}
	return "it is shutting down"
}
