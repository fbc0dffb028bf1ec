// Package peers carries shard replicas between the sidecars of one job:
// the Peer gRPC service on TCP with mutual TLS (Server), and the client
// that sends each drained shard to the peers that keep its rank's
// replicas and asks them for shards (Client, a tiers.Peers).
//
// Which peers keep rank r's replicas is a function of r and the peer
// list alone, so a sidecar on any node knows where to look: with the list
// sorted, the candidates are the R+1 entries after position r mod n; the
// sender sends to the first R of them that are not itself, and a reader
// asks every candidate but itself. Every sidecar of a job must be given
// the same list.
package peers

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// A shard read on the raw path is read in pieces of piece bytes (progress
// is reported after each). The client's gRPC connections, which fetch a
// shard when a peer has no raw path, have flow-control windows of window
// bytes per stream and connection and socket buffers of socketBuffer:
// gRPC's defaults (64 KiB windows probed upward, 32 KiB buffers) hold a
// loopback or datacenter link to a fraction of its bandwidth. The
// server's side is bounded for what a peer may hold (limits.go).
const (
	piece        = 4 << 20
	window       = 16 << 20
	socketBuffer = 1 << 20
)

// maxManifest bounds a replica's manifest, as readers of stored ones are.
const maxManifest = 256 << 20

// TLS is the mutual TLS of the peer service. Without CertFile the service
// refuses to run unless Insecure says plaintext is wanted.
type TLS struct {
	CertFile, KeyFile, CAFile string
	Insecure                  bool
	// ServerName, when set, is the name every peer's certificate must
	// carry, checked instead of the dialled host: peers found by DNS are
	// dialled by address (a Kubernetes pod's IP), which no certificate
	// made in advance can name.
	ServerName string
}

// Creds are one side's transport security: the TLS configuration (nil:
// plaintext) and the gRPC credentials made of it.
type Creds struct {
	TLS  *tls.Config
	GRPC credentials.TransportCredentials
}

// Protocol names the security for logs: "tls" or "insecure".
func (c Creds) Protocol() string { return c.GRPC.Info().SecurityProtocol }

// Credentials returns the server's and the client's transport security:
// each side presents its certificate and accepts only certificates signed
// by the CA.
func (t TLS) Credentials() (server, client Creds, err error) {
	if t.CertFile == "" && t.KeyFile == "" && t.CAFile == "" {
		if !t.Insecure {
			return Creds{}, Creds{}, errors.New("peers need --peer-cert, --peer-key and --peer-ca (mutual TLS), or --peer-insecure to send checkpoints in plaintext")
		}
		return Creds{GRPC: insecure.NewCredentials()}, Creds{GRPC: insecure.NewCredentials()}, nil
	}
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return Creds{}, Creds{}, fmt.Errorf("peer certificate: %w", err)
	}
	ca, err := os.ReadFile(t.CAFile)
	if err != nil {
		return Creds{}, Creds{}, fmt.Errorf("peer CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return Creds{}, Creds{}, fmt.Errorf("peer CA %s: no PEM certificate in it", t.CAFile)
	}
	// The server side names h2 for gRPC's clients, which insist on it; the
	// raw path's clients name nothing.
	sc := &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert,
		MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}
	cc := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS13, ServerName: t.ServerName}
	return Creds{TLS: sc, GRPC: credentials.NewTLS(sc)}, Creds{TLS: cc, GRPC: credentials.NewTLS(cc)}, nil
}

// candidates returns the peers that may keep rank's replicas, self
// excluded: of the R+1 entries of the sorted list after position rank mod
// n. The first R of them are the ones a sender (self) sends to.
func candidates(list []string, self string, rank, replicas int) []string {
	sorted := slices.Clone(list)
	slices.Sort(sorted)
	sorted = slices.Compact(sorted)
	n := len(sorted)
	var out []string
	for k := 1; k <= min(replicas+1, n); k++ {
		if p := sorted[(rank+k)%n]; p != self {
			out = append(out, p)
		}
	}
	return out
}

// Holders returns the peers self sends rank's shards to.
func Holders(list []string, self string, rank, replicas int) []string {
	c := candidates(list, self, rank, replicas)
	return c[:min(len(c), replicas)]
}

// Client is tiers.Peers over gRPC.
type Client struct {
	replicas int
	creds    Creds
	log      *slog.Logger

	mu    sync.Mutex // guards list, self and conns
	list  []string
	self  string
	conns map[string]*grpc.ClientConn
}

// Members returns the peer list and this sidecar's entry in it.
func (c *Client) Members() ([]string, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.list, c.self
}

// SetMembers replaces the peer list (discovered anew) and reports whether
// it changed. Connections to peers no longer listed are closed.
func (c *Client) SetMembers(list []string, self string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if slices.Equal(list, c.list) && self == c.self {
		return false
	}
	c.list, c.self = list, self
	for addr, cc := range c.conns {
		if !slices.Contains(list, addr) {
			_ = cc.Close()
			delete(c.conns, addr)
		}
	}
	return true
}

// NewClient returns the client of the peers in list (host:port each; self
// is this sidecar's own entry), keeping replicas copies of each shard.
func NewClient(list []string, self string, replicas int, creds Creds, log *slog.Logger) *Client {
	if log == nil {
		log = slog.Default()
	}
	return &Client{list: list, self: self, replicas: replicas, creds: creds, log: log, conns: map[string]*grpc.ClientConn{}}
}

// Close closes the connections to the peers.
func (c *Client) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, cc := range c.conns {
		_ = cc.Close()
	}
	c.conns = map[string]*grpc.ClientConn{}
}

func (c *Client) peer(addr string) (pb.PeerClient, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cc := c.conns[addr]
	if cc == nil {
		var err error
		cc, err = grpc.NewClient(addr, grpc.WithTransportCredentials(c.creds.GRPC),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(pb.MaxMessageBytes)),
			grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window),
			grpc.WithReadBufferSize(socketBuffer), grpc.WithWriteBufferSize(socketBuffer))
		if err != nil {
			return nil, err
		}
		c.conns[addr] = cc
	}
	return pb.NewPeerClient(cc), nil
}

// Replicate sends the shard to each of its rank's holders.
func (c *Client) Replicate(ctx context.Context, m *checkpoint.Manifest, data []byte, committed, memory bool) error {
	manifest, err := m.Encode()
	if err != nil {
		return err
	}
	list, self := c.Members()
	if self == "" {
		return errors.New("this sidecar is not in the peer list (yet): nowhere to send replicas from")
	}
	var errs []error
	hdr := &pb.ReplicaHeader{ManifestSize: uint64(len(manifest)), DataSize: uint64(len(data)), Committed: committed, MemoryOnly: memory,
		Job: m.Job, Step: m.Step, Rank: int32(m.Rank), WorldSize: int32(m.WorldSize), Attempt: m.Attempt}
	holders := Holders(list, self, m.Rank, c.replicas)
	if len(holders) < c.replicas {
		// A discovered list of fewer sidecars than --replicas asks (pods
		// still starting, a node lost): the copies that are missing are
		// not made, and the save must not be told it reached them.
		errs = append(errs, fmt.Errorf("the peer list %v holds %d other sidecars, fewer than the %d replicas asked", list, len(holders), c.replicas))
	}
	for _, addr := range holders {
		err := c.putRaw(ctx, addr, hdr, manifest, data)
		if err != nil && !errors.Is(err, errRefused) { // a peer from before the raw path, or a broken connection
			c.log.Debug("peers: the raw data path failed; sending through gRPC", "peer", addr, "err", err)
			err = c.put(ctx, addr, hdr, manifest, data)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("peer %s: %w", addr, err))
		}
	}
	return errors.Join(errs...)
}

func (c *Client) put(ctx context.Context, addr string, hdr *pb.ReplicaHeader, manifest, data []byte) error {
	p, err := c.peer(addr)
	if err != nil {
		return err
	}
	stream, err := p.PutReplica(ctx)
	if err != nil {
		return err
	}
	if err := sendPieces(hdr, manifest, data, stream.Send); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_, err = stream.CloseAndRecv()
	return err
}

// sendPieces sends hdr, then manifest and data in pieces of grpcPiece.
func sendPieces(hdr *pb.ReplicaHeader, manifest, data []byte, send func(*pb.ReplicaPiece) error) error {
	if err := send(&pb.ReplicaPiece{Header: hdr}); err != nil {
		return err
	}
	for _, b := range [][]byte{manifest, data} {
		for len(b) > 0 {
			n := min(len(b), grpcPiece)
			if err := send(&pb.ReplicaPiece{Data: b[:n]}); err != nil {
				return err
			}
			b = b[n:]
		}
	}
	return nil
}

// Candidates are the peers that may keep rank's replicas, this sidecar
// aside.
func (c *Client) Candidates(rank int) []string {
	list, self := c.Members()
	return candidates(list, self, rank, c.replicas)
}

// FetchManifest asks the peers in from, or the rank's holders, in turn
// for a shard's manifest, and returns it with the peer that answered.
func (c *Client) FetchManifest(ctx context.Context, job string, step int64, rank int, attempt string, from []string) (*checkpoint.Manifest, string, error) {
	if len(from) == 0 {
		list, self := c.Members()
		from = candidates(list, self, rank, c.replicas)
	}
	var errs []error
	for _, addr := range from {
		req := &pb.GetReplicaRequest{Job: job, Step: step, Rank: int32(rank), Attempt: attempt, ManifestOnly: true}
		manifest, err := c.fetchManifest(ctx, addr, req)
		if err == nil {
			var m *checkpoint.Manifest
			if m, err = checkpoint.ParseManifest(manifest); err == nil {
				return m, addr, nil
			}
		}
		errs = append(errs, fmt.Errorf("peer %s: %w", addr, err))
	}
	if len(errs) == 0 {
		return nil, "", errors.New("no peers to ask")
	}
	return nil, "", errors.Join(errs...)
}

// fetchManifest gets a manifest on the raw path, else through GetReplica
// (a peer from before the raw path, or a refusal gRPC words better).
func (c *Client) fetchManifest(ctx context.Context, addr string, req *pb.GetReplicaRequest) ([]byte, error) {
	var manifest []byte
	err := c.raw(ctx, addr, req, func(hdr *pb.ReplicaHeader, r io.Reader) error {
		manifest = make([]byte, hdr.GetManifestSize())
		_, err := io.ReadFull(r, manifest)
		return err
	})
	if err == nil || errors.Is(err, errRefused) {
		return manifest, err
	}
	c.log.Debug("peers: the raw data path failed; asking through gRPC", "peer", addr, "err", err)
	manifest, _, err = c.getGRPC(ctx, addr, req, 0)
	return manifest, err
}

// FetchData reads the data space of the shard m describes from peer into
// dst, which holds exactly m.DataSize bytes, calling progress with the
// bytes read so far as they arrive; it fails if the peer's copy is no
// longer described by m.
func (c *Client) FetchData(ctx context.Context, peer string, m *checkpoint.Manifest, dst []byte, progress func(int64)) error {
	want, err := m.Encode()
	if err != nil {
		return err
	}
	if int64(len(dst)) != m.DataSize {
		return fmt.Errorf("a destination of %d bytes for %d", len(dst), m.DataSize)
	}
	req := &pb.GetReplicaRequest{Job: m.Job, Step: m.Step, Rank: int32(m.Rank), Attempt: m.Attempt}
	err = c.raw(ctx, peer, req, func(hdr *pb.ReplicaHeader, r io.Reader) error {
		if hdr.GetManifestSize() != uint64(len(want)) || hdr.GetDataSize() != uint64(len(dst)) {
			return errors.New("the peer's copy changed since its manifest was read")
		}
		got := make([]byte, len(want))
		if _, err := io.ReadFull(r, got); err != nil || !bytes.Equal(got, want) {
			return errors.Join(errors.New("the peer's copy changed since its manifest was read"), err)
		}
		for off := 0; off < len(dst); off += piece {
			if _, err := io.ReadFull(r, dst[off:min(off+piece, len(dst))]); err != nil {
				return fmt.Errorf("a replica cut short: %w", err)
			}
			progress(int64(min(off+piece, len(dst))))
		}
		return nil
	})
	if err == nil || errors.Is(err, errRefused) {
		return err
	}
	c.log.Debug("peers: the raw data path failed; asking through gRPC", "peer", peer, "err", err)
	manifest, data, err := c.getGRPC(ctx, peer, req, m.DataSize)
	switch {
	case err != nil:
		return err
	case !bytes.Equal(manifest, want) || len(data) != len(dst):
		return errors.New("the peer's copy changed since its manifest was read")
	}
	copy(dst, data)
	progress(int64(len(dst)))
	return nil
}

// getGRPC gets a replica through GetReplica: its manifest's bytes and its
// data (none when the request asks for the manifest only).
func (c *Client) getGRPC(ctx context.Context, addr string, req *pb.GetReplicaRequest, maxBytes int64) (manifest, data []byte, err error) {
	p, err := c.peer(addr)
	if err != nil {
		return nil, nil, err
	}
	stream, err := p.GetReplica(ctx, req)
	if err != nil {
		return nil, nil, err
	}
	_, manifest, data, err = receive(stream.Recv, maxBytes, nil, nil, nil)
	return manifest, data, err
}

// inventoryTimeout bounds asking one peer what it holds: a restore waits
// no longer than this for a dead peer.
const inventoryTimeout = 3 * time.Second

// maxHeld bounds the shards taken from one peer's inventory, and
// maxInventory the bytes of its answer (a shard takes some 60 on the
// wire); askAtOnce bounds the peers asked at once, so that answers held
// at once are bounded too.
const (
	maxHeld      = 1 << 15
	maxInventory = 4 << 20
	askAtOnce    = 32
)

// Inventory asks every other peer at once what it holds of job.
func (c *Client) Inventory(ctx context.Context, job string) (map[string][]tiers.HeldShard, error) {
	ctx, cancel := context.WithTimeout(ctx, inventoryTimeout)
	defer cancel()
	var mu sync.Mutex
	out := map[string][]tiers.HeldShard{}
	err := c.eachPeer(func(addr string) error {
		held, err := c.inventory(ctx, addr, job)
		if err == nil {
			mu.Lock()
			out[addr] = held
			mu.Unlock()
		}
		return err
	})
	return out, err
}

// Persist tells every other peer at once that this sidecar persisted step.
func (c *Client) Persist(ctx context.Context, job string, step int64, attempt string) error {
	return c.eachPeer(func(addr string) error {
		p, err := c.peer(addr)
		if err == nil {
			_, err = p.Persist(ctx, &pb.PersistRequest{Job: job, Step: step, Attempt: attempt})
		}
		return err
	})
}

// eachPeer runs fn for every peer but this sidecar, askAtOnce at a time,
// and joins their errors, each naming its peer.
func (c *Client) eachPeer(fn func(addr string) error) error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	turns := make(chan struct{}, askAtOnce)
	list, self := c.Members()
	for _, addr := range slices.Compact(slices.Sorted(slices.Values(list))) {
		if addr == self {
			continue
		}
		turns <- struct{}{}
		wg.Go(func() {
			defer func() { <-turns }()
			if err := fn(addr); err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("peer %s: %w", addr, err))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (c *Client) inventory(ctx context.Context, addr, job string) ([]tiers.HeldShard, error) {
	p, err := c.peer(addr)
	if err != nil {
		return nil, err
	}
	resp, err := p.Inventory(ctx, &pb.InventoryRequest{Job: job}, grpc.MaxCallRecvMsgSize(maxInventory))
	if err != nil {
		return nil, err
	}
	held, dropped, err := parseInventory(resp)
	if dropped > 0 {
		c.log.Warn("peers: an inventory lists shards no sidecar can hold; left out", "peer", addr, "job", job, "shards", dropped)
	}
	return held, err
}

// parseInventory takes a peer's inventory: at most maxHeld shards, those
// that name a shard a sidecar can hold (a valid target and manifest
// hash); it says how many it left out.
func parseInventory(resp *pb.InventoryResponse) (held []tiers.HeldShard, dropped int, err error) {
	if len(resp.GetShards()) > maxHeld {
		return nil, 0, fmt.Errorf("an inventory of %d shards, more than %d", len(resp.GetShards()), maxHeld)
	}
	held = make([]tiers.HeldShard, 0, len(resp.GetShards()))
	for _, h := range resp.GetShards() {
		t := checkpoint.Target{Job: "job", Step: h.GetStep(), Rank: int(h.GetRank()), WorldSize: int(h.GetWorldSize()), Attempt: h.GetAttempt()}
		if t.Validate() != nil || h.GetManifestHash() != "" && !validHash(h.GetManifestHash()) {
			dropped++
			continue
		}
		held = append(held, tiers.HeldShard{Step: t.Step, Rank: t.Rank, WorldSize: t.WorldSize, Attempt: t.Attempt, Committed: h.GetCommitted(),
			MemoryOnly: h.GetMemoryOnly(), Created: time.Unix(0, h.GetCreatedUnixNano()), ManifestHash: h.GetManifestHash(), Original: h.GetOriginal()})
	}
	return held, dropped, nil
}

// validHash reports whether h is a manifest hash as commit records hold
// them.
func validHash(h string) bool {
	_, err := codec.ParseHash(h)
	return err == nil
}

// receive reads a header and the manifest and data it announces, refusing
// more than maxManifest and maxData bytes of them and what check (when
// not nil) refuses of the header; each goes into a buffer alloc makes
// (nil: new memory), which receive gives to giveBack when it fails after
// it.
func receive(recv func() (*pb.ReplicaPiece, error), maxData int64, check func(*pb.ReplicaHeader) error, alloc func(int64) ([]byte, error), giveBack func([]byte)) (*pb.ReplicaHeader, []byte, []byte, error) {
	first, err := recv()
	if err != nil {
		return nil, nil, nil, err
	}
	hdr := first.GetHeader()
	if hdr == nil {
		return nil, nil, nil, errors.New("the first piece of a replica has no header")
	}
	if err := tooLarge(hdr, maxData); err != nil {
		return nil, nil, nil, err
	}
	if check != nil {
		if err := check(hdr); err != nil {
			return nil, nil, nil, err
		}
	}
	if alloc == nil {
		alloc = func(n int64) ([]byte, error) { return make([]byte, n), nil }
		giveBack = func([]byte) {}
	}
	manifest, err := alloc(int64(hdr.GetManifestSize()))
	if err != nil {
		return nil, nil, nil, err
	}
	data, err := alloc(int64(hdr.GetDataSize()))
	if err != nil {
		giveBack(manifest)
		return nil, nil, nil, err
	}
	fail := func(err error) (*pb.ReplicaHeader, []byte, []byte, error) {
		giveBack(manifest)
		giveBack(data)
		return nil, nil, nil, err
	}
	want, got := uint64(len(manifest)+len(data)), uint64(0)
	for {
		piece, err := recv()
		if errors.Is(err, io.EOF) {
			break
		}
		b := piece.GetData()
		if err == nil && got+uint64(len(b)) > want {
			err = errors.New("a replica longer than its header says")
		}
		if err != nil {
			return fail(err)
		}
		n := copy(manifest[min(got, uint64(len(manifest))):], b)
		if n < len(b) { // the manifest is whole: the rest is data
			copy(data[got+uint64(n)-uint64(len(manifest)):], b[n:])
		}
		got += uint64(len(b))
	}
	if got != want {
		return fail(fmt.Errorf("a replica of %d bytes, its header says %d", got, want))
	}
	return hdr, manifest, data, nil
}

// Local is what the Peer service serves: this sidecar's memory tiers
// (a *tiers.Tiers).
type Local interface {
	// AcceptReplica keeps a peer's shard, want (its manifest must say
	// so), whose data is in a buffer ReplicaBuffer handed out (kept or
	// given back); ReplicaBuffer is room to receive want's n bytes into,
	// charged to the hot tier until given to AcceptReplica or back to
	// ReturnBuffer. Holds reports whether a shard is held already.
	AcceptReplica(want checkpoint.Target, manifest, data []byte, memory bool) error
	ReplicaBuffer(want checkpoint.Target, n int64) ([]byte, error)
	ReturnBuffer(b []byte)
	Holds(t checkpoint.Target) bool
	// Replica is a shard held for a peer, and the func to call once sent.
	Replica(job string, step int64, rank int, attempt string) (manifest, data []byte, committed bool, release func(), err error)
	// Inventory lists the shards of job held here.
	Inventory(job string) ([]tiers.HeldShard, error)
	// PersistStep is a peer's word that it persisted a step.
	PersistStep(job string, step int64, attempt string) error
}

// Server is the Peer service over a sidecar's memory tiers.
type Server struct {
	pb.UnimplementedPeerServer
	local    Local
	maxBytes int64
	// members is the peer list and this sidecar's entry, and replicas
	// how many copies of a rank are kept: whom the server serves (see
	// Members); names tells callers apart.
	members  func() ([]string, string)
	replicas int
	names    hostNames
	// receives bounds the replicas received at once; each one's bytes are
	// charged to the hot tier before the first is read.
	receives chan struct{}
}

// maxReceives is how many replicas a sidecar receives at once, and
// receiveWait how long one waits for its turn before it is refused.
const (
	maxReceives = 4
	receiveWait = time.Minute
)

// NewServer serves replicas into and out of local's hot tier, taking
// replicas of at most maxBytes (--hot-bytes), maxReceives at a time.
func NewServer(local Local, maxBytes int64) *Server {
	return &Server{local: local, maxBytes: maxBytes, receives: make(chan struct{}, maxReceives)}
}

// errBusy refuses a replica that waited receiveWait for its turn.
var errBusy = status.Error(codes.ResourceExhausted, "this sidecar is receiving as many replicas as it takes at once")

// turn waits for a receive's turn, until ctx ends or receiveWait passes;
// done ends the turn.
func (s *Server) turn(ctx context.Context) (done func(), err error) {
	t := time.NewTimer(receiveWait)
	defer t.Stop()
	select {
	case s.receives <- struct{}{}:
		return func() { <-s.receives }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
		return nil, errBusy
	}
}

// sendDeadline is how long a peer may take to send or take n bytes: a
// sender or reader slower than rawSendRate is cut off.
func sendDeadline(n uint64) time.Duration {
	return rawSendMin + time.Duration(n/rawSendRate)*time.Second
}

// PutReplica takes a replica sent through gRPC (a peer without the raw
// path) into the hot tier, within sendDeadline of its largest size: a
// slow sender does not hold its turn longer.
func (s *Server) PutReplica(stream grpc.ClientStreamingServer[pb.ReplicaPiece, pb.PutReplicaResponse]) error {
	done, err := s.turn(stream.Context())
	if err != nil {
		return err
	}
	defer done()
	type received struct {
		hdr            *pb.ReplicaHeader
		manifest, data []byte
		err            error
	}
	var want checkpoint.Target
	check := func(hdr *pb.ReplicaHeader) (err error) {
		want, err = s.maySend(callerFrom(stream.Context()), hdr)
		return err
	}
	got, abandoned := make(chan received), make(chan struct{})
	alloc := func(n int64) ([]byte, error) { return s.local.ReplicaBuffer(want, n) } // after check set want
	giveBack := func(b []byte) { s.local.ReturnBuffer(b) }
	// Owned by this call: it ends when the stream does, which returning
	// (at the deadline) ends; what it received then goes back.
	go func() {
		hdr, manifest, data, err := receive(stream.Recv, s.maxBytes, check, alloc, giveBack)
		select {
		case got <- received{hdr, manifest, data, err}:
		case <-abandoned:
			if err == nil {
				giveBack(manifest)
				giveBack(data)
			}
		}
	}()
	deadline := time.NewTimer(sendDeadline(maxManifest + uint64(max(s.maxBytes, 0))))
	defer deadline.Stop()
	var r received
	select {
	case r = <-got:
	case <-deadline.C:
		close(abandoned)
		return status.Error(codes.DeadlineExceeded, "a replica sent too slowly")
	}
	if r.err != nil {
		return r.err
	}
	err = s.local.AcceptReplica(want, r.manifest, r.data, r.hdr.GetMemoryOnly())
	giveBack(r.manifest)
	if err != nil {
		return err
	}
	return stream.SendAndClose(&pb.PutReplicaResponse{})
}

// tooLarge is the refusal of a replica of more than maxManifest bytes of
// manifest and maxData of data.
func tooLarge(hdr *pb.ReplicaHeader, maxData int64) error {
	if hdr.GetManifestSize() > maxManifest || hdr.GetDataSize() > uint64(max(maxData, 0)) {
		return fmt.Errorf("a replica of %d + %d bytes is more than this sidecar takes (%d + %d)",
			hdr.GetManifestSize(), hdr.GetDataSize(), maxManifest, maxData)
	}
	return nil
}

func (s *Server) GetReplica(req *pb.GetReplicaRequest, stream grpc.ServerStreamingServer[pb.ReplicaPiece]) error {
	manifest, data, committed, release, err := s.local.Replica(req.GetJob(), req.GetStep(), int(req.GetRank()), req.GetAttempt())
	if err != nil {
		return err
	}
	defer release()
	if req.GetManifestOnly() {
		data = nil
	}
	hdr := &pb.ReplicaHeader{ManifestSize: uint64(len(manifest)), DataSize: uint64(len(data)), Committed: committed}
	return sendPieces(hdr, manifest, data, stream.Send)
}

func (s *Server) Inventory(_ context.Context, req *pb.InventoryRequest) (*pb.InventoryResponse, error) {
	held, err := s.local.Inventory(req.GetJob())
	if err != nil {
		return nil, err
	}
	resp := &pb.InventoryResponse{Shards: make([]*pb.HeldShard, 0, len(held))}
	for _, h := range held {
		resp.Shards = append(resp.Shards, &pb.HeldShard{Step: h.Step, Rank: int32(h.Rank), WorldSize: int32(h.WorldSize), Attempt: h.Attempt,
			Committed: h.Committed, MemoryOnly: h.MemoryOnly, CreatedUnixNano: h.Created.UnixNano(), ManifestHash: h.ManifestHash,
			Original: h.Original})
	}
	return resp, nil
}

func (s *Server) Persist(_ context.Context, req *pb.PersistRequest) (*pb.PersistResponse, error) {
	if err := s.local.PersistStep(req.GetJob(), req.GetStep(), req.GetAttempt()); err != nil {
		return nil, err
	}
	return &pb.PersistResponse{}, nil
}

// Listen serves the Peer service on addr with creds until the func it
// returns is called, which stops it; it returns the listener's address
// (for addr ":0"). Every connection's TLS handshake is made here, then
// mux routes it to the raw data path or to gRPC (which then sees
// plaintext).
func Listen(addr string, creds Creds, srv *Server) (string, func(), error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, fmt.Errorf("peer listener: %w", err)
	}
	g := grpc.NewServer(append(serverOptions(), grpc.Creds(callerCreds{}),
		grpc.ChainUnaryInterceptor(srv.authUnary), grpc.ChainStreamInterceptor(srv.authStream))...)
	pb.RegisterPeerServer(g, srv)
	m := &mux{lis: lis, tls: creds.TLS, srv: srv, grpc: newChanListener(lis.Addr()), limit: newConnLimit()}
	go m.serve()
	go func() { _ = g.Serve(m.grpc) }()
	return lis.Addr().String(), func() { lis.Close(); m.grpc.Close(); g.Stop() }, nil
}
