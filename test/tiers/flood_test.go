package tiers

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/test/daemontest"
)

// dialPeer opens a TLS connection to the victim's peer port with the
// attacker's certificate (valid: the job's CA), speaking HTTP/2 as gRPC
// does.
func (v *victim) dialPeer(t *testing.T) (*tls.Conn, error) {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(v.certs.cert, v.certs.key)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := os.ReadFile(v.certs.ca)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	d := &net.Dialer{Timeout: testtime.Scale(30 * time.Second)}
	return tls.DialWithDialer(d, "tcp", v.addr, &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots,
		ServerName: "127.0.0.1", NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13})
}

// HTTP/2 by hand (RFC 9113), enough to open gRPC calls and ignore what
// the server says of its limits.
const h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

func h2Frame(typ, flags byte, stream uint32, payload []byte) []byte {
	b := make([]byte, 9, 9+len(payload))
	b[0], b[1], b[2] = byte(len(payload)>>16), byte(len(payload)>>8), byte(len(payload))
	b[3], b[4] = typ, flags
	binary.BigEndian.PutUint32(b[5:], stream)
	return append(b, payload...)
}

// h2Headers is a HEADERS frame opening a gRPC call of path, its fields
// as HPACK literals without indexing.
func h2Headers(stream uint32, path string) []byte {
	var block []byte
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":path", path}, {":authority", "127.0.0.1"},
		{"content-type", "application/grpc"}, {"te", "trailers"}} {
		block = append(block, 0x00, byte(len(f[0])))
		block = append(block, f[0]...)
		block = append(block, byte(len(f[1])))
		block = append(block, f[1]...)
	}
	return h2Frame(0x1, 0x4, stream, block) // END_HEADERS
}

// h2Refused counts the RST_STREAM frames with REFUSED_STREAM (7) read
// from r until it ends.
func h2Refused(r io.Reader, refused *atomic.Int64) {
	hdr := make([]byte, 9)
	for {
		if _, err := io.ReadFull(r, hdr); err != nil {
			return
		}
		payload := make([]byte, int(hdr[0])<<16|int(hdr[1])<<8|int(hdr[2]))
		if _, err := io.ReadFull(r, payload); err != nil {
			return
		}
		if hdr[3] == 0x3 && len(payload) == 4 && binary.BigEndian.Uint32(payload) == 7 {
			refused.Add(1)
		}
	}
}

// One connection opening 250 calls, each announcing a replica piece of a
// MiB and sending 64 KiB of it (the memory of one connection was
// unbounded: every call buffered its messages, and 250 exhausted the
// sidecar): the sidecar runs 4 at once and refuses the others.
func TestPeerStreamFlood(t *testing.T) {
	v := startVictim(t)
	c, err := v.dialPeer(t)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var refused atomic.Int64
	read := make(chan struct{})
	go func() { defer close(read); h2Refused(c, &refused) }()
	const calls = 250
	piece := make([]byte, 5+64<<10) // a gRPC message header announcing 1 MiB, and the first 64 KiB
	binary.BigEndian.PutUint32(piece[1:], 1<<20)
	out := append([]byte(h2Preface), h2Frame(0x4, 0, 0, nil)...) // SETTINGS
	if _, err := c.Write(out); err != nil {
		t.Fatal(err)
	}
	for i := range uint32(calls) {
		stream := 2*i + 1
		if _, err := c.Write(append(h2Headers(stream, "/ckptd.v1.Peer/PutReplica"), h2Frame(0x0, 0, stream, piece[:16<<10])...)); err != nil {
			t.Logf("the sidecar cut the connection after %d calls: %v", i, err)
			break
		}
	}
	daemontest.WaitUntil(t, "the sidecar refuses the calls past its 4 a connection", func() bool { return refused.Load() >= calls-4 })
	t.Logf("answer: %d of %d calls refused (REFUSED_STREAM)", refused.Load(), calls)
	c.Close()
	<-read
	v.check(t, "250 calls on one connection")
}

// 2,000 connections from one host, each through the TLS handshake and
// the HTTP/2 preface, then silent (some 2,800 exhausted a sidecar): the
// sidecar keeps 32 of them and closes the others at once.
func TestPeerConnectionFlood(t *testing.T) {
	v := startVictim(t)
	const conns = 2000
	var (
		mu     sync.Mutex
		held   []net.Conn
		closed atomic.Int64
		wg     sync.WaitGroup
	)
	defer func() {
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()
	for range conns {
		c, err := v.dialPeer(t)
		if err != nil { // refused before the handshake
			closed.Add(1)
			continue
		}
		if _, err := c.Write([]byte(h2Preface)); err != nil {
			closed.Add(1)
			c.Close()
			continue
		}
		mu.Lock()
		held = append(held, c)
		mu.Unlock()
		wg.Go(func() {
			_, _ = io.Copy(io.Discard, c) // until the sidecar closes it, or the test does
			closed.Add(1)
		})
	}
	daemontest.WaitUntil(t, "the sidecar closes the connections past 32 from one host", func() bool { return closed.Load() >= conns-32 })
	t.Logf("answer: %d of %d connections closed at once", closed.Load(), conns)
	mu.Lock()
	for _, c := range held {
		c.Close()
	}
	mu.Unlock()
	wg.Wait()
	v.check(t, "2,000 idle connections from one host")
}
