package peers

import (
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// What one peer, or all of them, can hold of a sidecar. A sidecar of a job
// opens a handful of connections to each peer (one for gRPC, one per raw
// transfer); these bounds are far above that and far below what exhausts
// a sidecar's memory (one connection with 250 streams did, as did some
// 2,800 idle connections).
const (
	// connsPerHost bounds the connections from one remote address (a
	// peer's sidecar, or whoever holds a certificate there); maxConns
	// bounds them all. A connection past either is closed at once,
	// before its TLS handshake.
	connsPerHost = 32
	maxConns     = 1024
	// streamsPerConn bounds the gRPC calls a connection runs at once
	// (HTTP/2 refuses more): each buffers up to one message.
	streamsPerConn = 4
	// idleConn is how long a gRPC connection without calls stays open.
	idleConn = 5 * time.Minute
	// grpcPiece is a piece of a replica sent through gRPC (the fallback
	// of the raw path), and grpcMaxMessage the largest message the peers'
	// gRPC server takes: each stream buffers one whole message.
	grpcPiece      = 1 << 20
	grpcMaxMessage = grpcPiece + 64<<10
	// grpcWindow is the server's flow-control window for each stream
	// (fixed: gRPC's dynamic windows grow to 16 MiB a stream, which a
	// sender that is never read from would fill), grpcConnWindow for each
	// connection.
	grpcWindow     = 64 << 10
	grpcConnWindow = 256 << 10
)

// serverOptions bound what a peer can hold of the peers' gRPC server.
func serverOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(grpcMaxMessage),
		grpc.MaxConcurrentStreams(streamsPerConn),
		grpc.InitialWindowSize(grpcWindow), grpc.InitialConnWindowSize(grpcConnWindow),
		grpc.MaxHeaderListSize(16 << 10),
		// A connection with no call for idleConn is closed; one whose
		// peer stops answering pings is cut off after 2m20s.
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: idleConn, Time: 2 * time.Minute, Timeout: 20 * time.Second}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
}

// connLimit counts the peer port's open connections, by remote host and
// in all.
type connLimit struct {
	mu     sync.Mutex
	byHost map[string]int
	total  int
}

func newConnLimit() *connLimit { return &connLimit{byHost: map[string]int{}} }

// admit counts c in, or refuses it (false) when its host or the port has
// as many as allowed; an admitted connection is counted out when closed.
func (l *connLimit) admit(c net.Conn) (net.Conn, bool) {
	host := c.RemoteAddr().String()
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total >= maxConns || l.byHost[host] >= connsPerHost {
		return nil, false
	}
	l.total++
	l.byHost[host]++
	return &countedConn{Conn: c, done: func() { l.leave(host) }}, true
}

func (l *connLimit) leave(host string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if l.byHost[host]--; l.byHost[host] <= 0 {
		delete(l.byHost, host)
	}
}

// countedConn is an admitted connection, counted out once when closed.
type countedConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}
