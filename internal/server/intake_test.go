package server

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/ckptd/ckptd/internal/peercred"
)

// sinkDesc is a service of one unary call (Echo: the length of what it
// got) and one client stream (Sink: the bytes of all it got), to drive
// the intake as the daemon's services do.
var sinkDesc = grpc.ServiceDesc{
	ServiceName: "intaketest.Sink",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Echo", Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
		in := new(wrapperspb.BytesValue)
		if err := dec(in); err != nil {
			return nil, err
		}
		return wrapperspb.Int64(int64(len(in.Value))), nil
	}}},
	Streams: []grpc.StreamDesc{{StreamName: "Sink", ClientStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		n := 0
		for {
			m := new(wrapperspb.BytesValue)
			err := ss.RecvMsg(m)
			if errors.Is(err, io.EOF) {
				return ss.SendMsg(wrapperspb.Int64(int64(n)))
			}
			if err != nil {
				return err
			}
			n += len(m.Value)
		}
	}}},
}

// serveIntake serves sinkDesc on a unix socket through an intake of lim,
// as the daemon does; it returns the socket.
func serveIntake(t *testing.T, lim IntakeLimits) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	in := NewIntake(lim)
	srv := grpc.NewServer(in.ServerOptions()...)
	in.Registrar(srv).RegisterService(&sinkDesc, struct{}{})
	go srv.Serve(in.Listener(peercred.NewListener(l, peercred.Policy{UID: os.Geteuid(), GID: -1}, in.Closed, nil)))
	t.Cleanup(srv.Stop)
	return sock
}

func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	c, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func echo(ctx context.Context, c *grpc.ClientConn) error {
	return c.Invoke(ctx, "/intaketest.Sink/Echo", wrapperspb.Bytes([]byte("hello")), new(wrapperspb.Int64Value))
}

func openSink(t *testing.T, ctx context.Context, c *grpc.ClientConn) grpc.ClientStream {
	t.Helper()
	s, err := c.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, "/intaketest.Sink/Sink")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func wantExhausted(t *testing.T, err error, bound string) {
	t.Helper()
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(status.Convert(err).Message(), bound) {
		t.Fatalf("got %v, want RESOURCE_EXHAUSTED naming %q", err, bound)
	}
}

// Calls past the bound (here one uid's share: 3 of 4) are refused before
// anything of them is read, and are taken again once one ends.
func TestIntakeBoundsCalls(t *testing.T) {
	sock := serveIntake(t, IntakeLimits{Conns: 100, Calls: 4, Requests: 100})
	c := dial(t, sock)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var open []grpc.ClientStream
	for range 3 {
		s := openSink(t, ctx, c)
		if err := s.SendMsg(wrapperspb.Bytes([]byte("x"))); err != nil {
			t.Fatal(err)
		}
		open = append(open, s)
	}
	wantExhausted(t, echo(ctx, c), "calls")
	if err := open[0].CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := open[0].RecvMsg(new(wrapperspb.Int64Value)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return echo(ctx, c) == nil })
}

// Connections past the bound (here one uid's share: 1 of 2) get
// RESOURCE_EXHAUSTED on every call; past twice the bound they are closed
// at once; one closing makes room.
func TestIntakeBoundsConnections(t *testing.T) {
	sock := serveIntake(t, IntakeLimits{Conns: 2, Calls: 100, Requests: 100})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	first := dial(t, sock)
	if err := echo(ctx, first); err != nil {
		t.Fatal(err)
	}
	second := dial(t, sock)
	wantExhausted(t, echo(ctx, second), "connections")
	var raws []net.Conn
	for range 3 { // the 3rd and 4th are counted; the 5th is past twice the bound
		raw, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		raws = append(raws, raw)
	}
	last := raws[2]
	last.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := last.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("a connection past twice the bound: read %v, want EOF", err)
	}
	first.Close()
	second.Close()
	for _, r := range raws {
		r.Close()
	}
	waitFor(t, func() bool {
		c := dial(t, sock)
		defer c.Close()
		return echo(ctx, c) == nil
	})
}

// A request waits for a reading slot rather than fail: here a stream
// whose handler waits for its next message holds the uid's only slot.
func TestIntakeRequestsWaitForASlot(t *testing.T) {
	sock := serveIntake(t, IntakeLimits{Conns: 100, Calls: 100, Requests: 2})
	c := dial(t, sock)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := openSink(t, ctx, c)
	if err := s.SendMsg(wrapperspb.Bytes(make([]byte, 1<<20))); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the handler reads it and waits for the next, holding the slot
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if err := echo(short, c); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a request while the only slot is held: %v, want it to wait until its deadline", err)
	}
	done := make(chan error, 1)
	go func() { done <- echo(ctx, c) }()
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got := new(wrapperspb.Int64Value)
	if err := s.RecvMsg(got); err != nil || got.Value != 1<<20 {
		t.Fatalf("the stream: %v, %d bytes", err, got.Value)
	}
	if err := <-done; err != nil {
		t.Fatalf("the request that waited: %v", err)
	}
}

func waitFor(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
	}
}

func TestIntakeBytes(t *testing.T) {
	if got := DefaultIntake.Bytes(); got <= 0 || got > 512<<20 { // --print-memory adds it to the heap's ceiling
		t.Fatalf("the default intake holds %d bytes", got)
	}
}
