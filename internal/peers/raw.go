package peers

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// The raw data path: a shard fetched through GetReplica crosses gRPC's
// HTTP/2 framing (16 KiB frames, a copy per message on each side), which
// holds it to well under half of what the link carries. So the peer port
// also takes plain connections that open with rawPreface: one request,
// framed by hand, answered by a header and the shard's bytes as they are,
// read straight into the fetch buffer. The TLS handshake (the same mutual
// TLS) comes first on every connection, whichever path it then takes.
// rawPut opens one that sends a replica: a ReplicaHeader, framed, then
// the manifest's and the data's bytes, answered by a ReplicaHeader that
// carries the refusal, if any.
const (
	rawPreface = "CKPTDRAW"
	rawPut     = "CKPTDPUT"
)

// errRefused wraps a peer's refusal on the raw path (no such shard, no
// room, too large): the same request through gRPC would be refused too.
var errRefused = errors.New("refused")

// maxFrame bounds a framed message of the raw path (a request or a
// header: a few hundred bytes).
const maxFrame = 64 << 10

// handshakeTimeout bounds a new connection's TLS handshake and first
// bytes; rawSendMin and rawSendRate bound sending a shard: a reader that
// stalls does not pin a hot-tier entry for long.
const (
	handshakeTimeout = 10 * time.Second
	rawSendMin       = time.Minute
	rawSendRate      = 50 << 20 // bytes per second, the slowest a reader may take them
)

// mux routes the peer port's connections: the raw path to the Server,
// anything else (gRPC's HTTP/2 preface) to the gRPC server's listener.
type mux struct {
	lis   net.Listener
	tls   *tls.Config // nil: plaintext (--peer-insecure)
	srv   *Server
	grpc  *chanListener
	limit *connLimit
}

func (m *mux) serve() {
	for {
		c, err := m.lis.Accept()
		if err != nil {
			return // the listener closed: Listen's stop
		}
		counted, ok := m.limit.admit(c)
		if !ok { // too many from its host, or in all
			c.Close()
			continue
		}
		go m.route(counted)
	}
}

func (m *mux) route(c net.Conn) {
	_ = c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	var cert *x509.Certificate
	if m.tls != nil {
		tc := tls.Server(c, m.tls)
		if err := tc.Handshake(); err != nil {
			c.Close()
			return
		}
		if certs := tc.ConnectionState().PeerCertificates; len(certs) > 0 {
			cert = certs[0]
		}
		c = tc
	}
	br := bufio.NewReaderSize(c, 64)
	head, err := br.Peek(len(rawPreface))
	if err != nil {
		c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	pc := &peekedConn{Conn: c, r: br, cert: cert}
	switch string(head) {
	case rawPreface:
		m.srv.serveRaw(pc)
		return
	case rawPut:
		m.srv.serveRawPut(pc)
		return
	}
	m.grpc.deliver(pc)
}

// peekedConn is a connection whose first bytes were peeked: reads go
// through the reader that holds them. cert is the certificate its peer
// presented in the TLS handshake (nil: plaintext).
type peekedConn struct {
	net.Conn
	r    *bufio.Reader
	cert *x509.Certificate
}

func (c *peekedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// chanListener is the gRPC server's listener: the connections mux hands
// it.
type chanListener struct {
	addr  net.Addr
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newChanListener(addr net.Addr) *chanListener {
	return &chanListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *chanListener) deliver(c net.Conn) {
	select {
	case l.conns <- c:
	case <-l.done:
		c.Close()
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.addr }

// serveRaw answers one raw request: the shard the peer asks for.
func (s *Server) serveRaw(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	req := &pb.GetReplicaRequest{}
	if _, err := io.ReadFull(c, make([]byte, len(rawPreface))); err != nil {
		return
	}
	if err := readFrame(c, req); err != nil {
		return
	}
	if err := s.mayCall(callerOf(c)); err != nil {
		_ = writeFrame(c, &pb.ReplicaHeader{Error: err.Error()})
		return
	}
	manifest, data, committed, release, err := s.local.Replica(req.GetJob(), req.GetStep(), int(req.GetRank()), req.GetAttempt())
	if err != nil {
		_ = writeFrame(c, &pb.ReplicaHeader{Error: err.Error()})
		return
	}
	defer release()
	_ = c.SetDeadline(time.Now().Add(sendDeadline(uint64(len(manifest) + len(data)))))
	hdr := &pb.ReplicaHeader{ManifestSize: uint64(len(manifest)), DataSize: uint64(len(data)), Committed: committed}
	if writeFrame(c, hdr) != nil {
		return
	}
	if _, err := c.Write(manifest); err != nil || req.GetManifestOnly() {
		return
	}
	_, _ = c.Write(data)
}

// serveRawPut takes one replica sent on the raw path into the hot tier,
// maxReceives at a time (as PutReplica), its bytes charged to the tier
// before the first is read and read straight into the buffer the tier
// keeps, within sendDeadline.
func (s *Server) serveRawPut(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
	hdr := &pb.ReplicaHeader{}
	if _, err := io.ReadFull(c, make([]byte, len(rawPut))); err != nil || readFrame(c, hdr) != nil {
		return
	}
	answer := func(err error) {
		if err != nil {
			_ = writeFrame(c, &pb.ReplicaHeader{Error: err.Error()})
		} else {
			_ = writeFrame(c, &pb.ReplicaHeader{})
		}
	}
	if err := tooLarge(hdr, s.maxBytes); err != nil {
		answer(err)
		return
	}
	want, err := s.maySend(callerOf(c), hdr)
	if err != nil {
		answer(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), receiveWait)
	done, err := s.turn(ctx)
	cancel()
	if err != nil {
		_ = c.SetDeadline(time.Now().Add(handshakeTimeout))
		answer(err)
		return
	}
	defer done()
	_ = c.SetDeadline(time.Now().Add(sendDeadline(hdr.GetManifestSize() + hdr.GetDataSize())))
	manifest, err := s.local.ReplicaBuffer(want, int64(hdr.GetManifestSize()))
	if err != nil {
		answer(err)
		return
	}
	defer s.local.ReturnBuffer(manifest)
	data, err := s.local.ReplicaBuffer(want, int64(hdr.GetDataSize()))
	if err != nil {
		answer(err)
		return
	}
	for _, b := range [][]byte{manifest, data} {
		if _, err := io.ReadFull(c, b); err != nil {
			s.local.ReturnBuffer(data)
			return
		}
	}
	answer(s.local.AcceptReplica(want, manifest, data, hdr.GetMemoryOnly()))
}

// putRaw sends a replica on the raw path; a refusal wraps errRefused.
func (c *Client) putRaw(ctx context.Context, addr string, hdr *pb.ReplicaHeader, manifest, data []byte) error {
	conn, done, err := c.openRaw(ctx, addr, rawPut, hdr)
	if err != nil {
		return err
	}
	defer done()
	for _, b := range [][]byte{manifest, data} {
		if _, err := conn.Write(b); err != nil {
			return err
		}
	}
	_, err = readAnswer(conn)
	return err
}

// raw makes one request on the raw path to addr and hands the answer's
// header and the stream of bytes after it to read, unless the peer
// refused (errRefused).
func (c *Client) raw(ctx context.Context, addr string, req *pb.GetReplicaRequest, read func(*pb.ReplicaHeader, io.Reader) error) error {
	conn, done, err := c.openRaw(ctx, addr, rawPreface, req)
	if err != nil {
		return err
	}
	defer done()
	hdr, err := readAnswer(conn)
	if err != nil {
		return err
	}
	if hdr.GetManifestSize() > maxManifest {
		return fmt.Errorf("a manifest of %d bytes, more than %d", hdr.GetManifestSize(), maxManifest)
	}
	return read(hdr, conn)
}

// openRaw connects to addr's raw path and sends preface and msg; done
// closes the connection, which ctx ending closes too (a cancelled restore
// stops its read).
func (c *Client) openRaw(ctx context.Context, addr, preface string, msg proto.Message) (conn net.Conn, done func(), err error) {
	if conn, err = c.dialRaw(ctx, addr); err != nil {
		return nil, nil, err
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	done = func() { stop(); conn.Close() }
	if _, err = io.WriteString(conn, preface); err == nil {
		err = writeFrame(conn, msg)
	}
	if err != nil {
		done()
		return nil, nil, err
	}
	return conn, done, nil
}

// readAnswer reads a peer's framed ReplicaHeader; the refusal it carries,
// if any, is an error wrapping errRefused.
func readAnswer(r io.Reader) (*pb.ReplicaHeader, error) {
	hdr := &pb.ReplicaHeader{}
	if err := readFrame(r, hdr); err != nil {
		return nil, err
	}
	if hdr.GetError() != "" {
		return nil, fmt.Errorf("%w: %s", errRefused, hdr.GetError())
	}
	return hdr, nil
}

// dialRaw connects to a peer's port for the raw path, with the mutual TLS
// gRPC uses.
func (c *Client) dialRaw(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil || c.creds.TLS == nil {
		return conn, err
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		conn.Close()
		return nil, err
	}
	conf := c.creds.TLS.Clone()
	if conf.ServerName == "" { // else --peer-server-name: every peer's certificate carries that name
		conf.ServerName = host
	}
	tc := tls.Client(conn, conf)
	if err := tc.HandshakeContext(ctx); err != nil {
		conn.Close()
		return nil, err
	}
	return tc, nil
}

// writeFrame writes msg as a 4-byte big-endian length and its bytes.
func writeFrame(w io.Writer, msg proto.Message) error {
	b, err := proto.Marshal(msg)
	if err != nil {
		return err
	}
	frame := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(b)), uint32(len(b)))
	_, err = w.Write(append(frame, b...))
	return err
}

// readFrame reads what writeFrame writes, at most maxFrame bytes of it.
func readFrame(r io.Reader, msg proto.Message) error {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > maxFrame {
		return fmt.Errorf("a frame of %d bytes, more than %d", size, maxFrame)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(r, b); err != nil {
		return err
	}
	return proto.Unmarshal(b, msg)
}
