package peers

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// Who may call a sidecar's peer port. A connection is taken for one of
// the sidecars of the peer list (but this one) when, with mutual TLS, its
// certificate names that entry's host (as a dialler checks a server's),
// or, in plaintext or when every certificate carries one name
// (--peer-server-name), it comes from that entry's address. Only such a
// caller is served at all (inventories, shards, persist notices), and a
// replica of rank r is taken only from an entry that sends rank r's
// replicas to this sidecar (Holders), for a shard this sidecar does not
// hold: a node of the job can send only its own ranks' replicas, and only
// where they belong. Each node should have a certificate of its own,
// naming only its own addresses: sidecars sharing one certificate are
// told apart by nothing.

// caller is who is on a peer connection: its address and, with TLS, the
// certificate it presented. It is the connection's gRPC AuthInfo.
type caller struct {
	credentials.CommonAuthInfo
	ip   net.IP
	cert *x509.Certificate // nil: plaintext
}

func (caller) AuthType() string { return "ckptd-peer" }

// String names the caller for refusals.
func (c caller) String() string {
	if c.cert == nil {
		return fmt.Sprintf("%s (plaintext)", c.ip)
	}
	return fmt.Sprintf("%s (certificate %q, %s)", c.ip, c.cert.Subject.String(), sans(c.cert))
}

// callerOf is who is on c, a connection the mux handed on (a peekedConn
// after its TLS handshake).
func callerOf(c net.Conn) caller {
	who := caller{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		who.ip = a.IP
	}
	if pc, ok := c.(*peekedConn); ok && pc.cert != nil {
		who.cert, who.SecurityLevel = pc.cert, credentials.PrivacyAndIntegrity
	}
	return who
}

// callerCreds are the peers' gRPC server's transport credentials: the
// mux made the TLS handshake already; they only hand gRPC the caller as
// its AuthInfo.
type callerCreds struct{}

func (callerCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return c, callerOf(c), nil
}

func (callerCreds) ClientHandshake(context.Context, string, net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("the peers' server credentials dial nothing")
}

func (callerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "ckptd-peer"}
}
func (callerCreds) Clone() credentials.TransportCredentials { return callerCreds{} }
func (callerCreds) OverrideServerName(string) error         { return nil }

// errNoMembers refuses every call of a server without a peer list.
var errNoMembers = status.Error(codes.PermissionDenied, "this sidecar has no peer list: it takes no peer calls")

// Members makes s serve the sidecars of c's peer list only, taking
// replicas of a rank only from those that send that rank's replicas to
// this sidecar (see the comment above). A server without it refuses
// every call.
func (s *Server) Members(c *Client) *Server {
	s.members, s.replicas = c.Members, c.replicas
	// Certificates that all carry one name (--peer-server-name) tell
	// sidecars apart by nothing: the caller's address does then.
	s.names.byAddress = c.creds.TLS != nil && c.creds.TLS.ServerName != ""
	return s
}

// entries returns the entries of the peer list, this sidecar's aside,
// that who may be, and this sidecar's own entry; an error, a gRPC
// PERMISSION_DENIED, when there is none.
func (s *Server) entries(who caller) (from []string, list []string, self string, err error) {
	if s.members == nil {
		return nil, nil, "", errNoMembers
	}
	list, self = s.members()
	for _, e := range slices.Compact(slices.Sorted(slices.Values(list))) {
		if e != self && s.names.is(who, e) {
			from = append(from, e)
		}
	}
	if len(from) == 0 {
		return nil, nil, "", status.Errorf(codes.PermissionDenied, "peer %s is none of this sidecar's peers %v", who, list)
	}
	return from, list, self, nil
}

// mayCall refuses who unless it is one of the sidecar's peers.
func (s *Server) mayCall(who caller) error {
	_, _, _, err := s.entries(who)
	return err
}

// maySend refuses a replica hdr announces unless who is a sidecar that
// sends hdr's rank's replicas to this one, and this one does not hold
// that shard already. It names the shard as a Target.
func (s *Server) maySend(who caller, hdr *pb.ReplicaHeader) (checkpoint.Target, error) {
	t := checkpoint.Target{Job: hdr.GetJob(), Step: hdr.GetStep(), Rank: int(hdr.GetRank()), WorldSize: int(hdr.GetWorldSize()), Attempt: hdr.GetAttempt()}
	if err := t.Validate(); err != nil {
		return t, status.Errorf(codes.InvalidArgument, "a replica's header: %v", err)
	}
	from, list, self, err := s.entries(who)
	if err != nil {
		return t, err
	}
	allowed := false
	for _, e := range from {
		allowed = allowed || slices.Contains(Holders(list, e, t.Rank, s.replicas), self)
	}
	if !allowed {
		return t, status.Errorf(codes.PermissionDenied, "peer %s (%v in the peer list) does not send rank %d's replicas to this sidecar", who, from, t.Rank)
	}
	if s.local.Holds(t) {
		return t, status.Errorf(codes.AlreadyExists, "a replica of %s is refused: it is held here already, and a replica never replaces it", t)
	}
	return t, nil
}

// authUnary and authStream refuse a gRPC call unless its caller is one
// of the sidecar's peers.
func (s *Server) authUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := s.mayCall(callerFrom(ctx)); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (s *Server) authStream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := s.mayCall(callerFrom(ss.Context())); err != nil {
		return err
	}
	return h(srv, ss)
}

// callerFrom is the caller of a gRPC call.
func callerFrom(ctx context.Context) caller {
	if p, ok := peer.FromContext(ctx); ok {
		if who, ok := p.AuthInfo.(caller); ok {
			return who
		}
	}
	return caller{}
}

// hostNames tells whether a caller is a peer-list entry: with a
// certificate, whether it names the entry's host; in plaintext, whether
// the caller's address is the host's (a name is looked up, the answer
// kept for a while).
type hostNames struct {
	byAddress bool // by the caller's address even with a certificate
	mu        sync.Mutex
	addrs     map[string]resolved
}

type resolved struct {
	ips []net.IP
	at  time.Time
}

// resolveTTL is how long a name's addresses are kept; resolveTimeout
// bounds looking one up.
const (
	resolveTTL     = 30 * time.Second
	resolveTimeout = 2 * time.Second
	maxResolved    = 4096
)

func (n *hostNames) is(who caller, entry string) bool {
	host, _, err := net.SplitHostPort(entry)
	if err != nil || host == "" {
		return false
	}
	if who.cert != nil && !n.byAddress {
		return who.cert.VerifyHostname(host) == nil
	}
	if who.ip == nil {
		return false
	}
	if ip := net.ParseIP(host); ip != nil {
		return ip.Equal(who.ip)
	}
	return slices.ContainsFunc(n.lookup(host), who.ip.Equal)
}

func (n *hostNames) lookup(host string) []net.IP {
	n.mu.Lock()
	r, ok := n.addrs[host]
	n.mu.Unlock()
	if ok && time.Since(r.at) < resolveTTL {
		return r.ips
	}
	ctx, cancel := context.WithTimeout(context.Background(), resolveTimeout)
	defer cancel()
	addrs, _ := net.DefaultResolver.LookupHost(ctx, strings.TrimSuffix(host, "."))
	var ips []net.IP
	for _, a := range addrs {
		if ip := net.ParseIP(a); ip != nil {
			ips = append(ips, ip)
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.addrs == nil || len(n.addrs) >= maxResolved {
		n.addrs = map[string]resolved{}
	}
	n.addrs[host] = resolved{ips, time.Now()}
	return ips
}
