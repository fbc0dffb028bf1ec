package server

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/ckptd/ckptd/internal/peercred"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// IntakeLimits bound what the socket takes in at once, across all its
// clients: open connections, calls in progress, and requests being read
// (each may be up to pb.MaxMessageBytes, and gRPC allocates a request's
// buffer when its length arrives, before its bytes do). One client uid
// gets at most three quarters of each, so that another user's trainers
// keep a share.
type IntakeLimits struct {
	Conns    int // connections open
	Calls    int // calls in progress (a stream is one call)
	Requests int // requests being read
}

// DefaultIntake suits a node of many trainers with DataLoader workers:
// a few hundred connections, each with a handful of calls.
var DefaultIntake = IntakeLimits{Conns: 512, Calls: 512, Requests: 16}

// CallWindow is each call's flow-control window: what gRPC buffers for a
// call whose handler is not reading (gRPC would otherwise grow it up to
// 16 MiB per call). connCost is what a connection with a call open costs
// besides: its read and write buffers, transport state and goroutines'
// stacks (about 400 KiB measured, with the call; see TestSocketFlood).
const (
	CallWindow = 256 << 10
	connCost   = 256 << 10
)

// Bytes is the most the intake holds at once: connections' buffers, the
// calls' windows and the requests being read.
func (l IntakeLimits) Bytes() int64 {
	return int64(l.Conns)*connCost + int64(l.Calls)*CallWindow + int64(l.Requests)*pb.MaxMessageBytes
}

// uidShare is what one uid may hold of a bound of n.
func uidShare(n int) int { return max(1, n*3/4) }

// Intake enforces IntakeLimits: its listener counts connections (Closed,
// given to peercred.NewListener, counts them out), its tap handle refuses
// peers the socket's policy does not allow and counts calls before gRPC
// reads anything of them, and its
// registrar makes every request wait for a reading slot before its bytes
// are read. Past the connection or call bound a call fails with
// RESOURCE_EXHAUSTED naming the bound; a request waits for its slot (the
// call's deadline still applies): reading takes microseconds, and a burst
// of requests queues rather than fails.
type Intake struct {
	// Refused, when set, is told each connection or call refused and the
	// bound it hit ("connections", "calls"): the daemon counts them.
	Refused func(bound string)

	lim     IntakeLimits
	mu      sync.Mutex
	conns   tally
	calls   tally
	over    map[string]bool // connections past the bound, by peercred id: their calls are refused
	reading tally           // reading slots held
	waiting int             // requests waiting for a slot
	freed   chan struct{}   // closed and replaced when a slot frees while some wait
}

// tally counts what is held, in total and by uid.
type tally struct {
	total int
	byUID map[int]int
}

func (t *tally) take(uid, limit int) bool {
	if t.total >= limit || t.byUID[uid] >= uidShare(limit) {
		return false
	}
	t.force(uid)
	return true
}

// force counts one more past the bound.
func (t *tally) force(uid int) {
	if t.byUID == nil {
		t.byUID = map[int]int{}
	}
	t.total++
	t.byUID[uid]++
}

func (t *tally) give(uid int) {
	t.total--
	if t.byUID[uid]--; t.byUID[uid] <= 0 {
		delete(t.byUID, uid)
	}
}

// NewIntake returns an Intake enforcing lim.
func NewIntake(lim IntakeLimits) *Intake {
	return &Intake{lim: lim, over: map[string]bool{}, freed: make(chan struct{})}
}

// ServerOptions are the gRPC options the intake needs.
func (in *Intake) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InTapHandle(in.tap),
		grpc.InitialWindowSize(CallWindow),
		grpc.InitialConnWindowSize(4 * CallWindow),
		grpc.ChainStreamInterceptor(in.streamInterceptor),
	}
}

// uidOf is the uid of the connection a call came on; -1 when it did not
// come through a peercred listener.
func uidOf(ctx context.Context) (int, *peercred.Info) {
	if info, ok := peercred.FromContext(ctx); ok {
		return info.UID, info
	}
	return -1, nil
}

// exhausted is the refusal of a call past a bound of lim: the total, or
// the uid's share of it.
func exhausted(what string, lim int, t *tally, uid int) error {
	held := fmt.Sprintf("it holds %d", lim)
	if t.total < lim {
		held = fmt.Sprintf("one uid may hold %d (uid %d holds %d)", uidShare(lim), uid, t.byUID[uid])
	}
	return withInfo(codes.ResourceExhausted,
		fmt.Sprintf("the daemon's socket takes %d %s at once and %s: close idle clients, or use fewer connections", lim, what, held),
		pb.ErrorReason_OVER_BUDGET, map[string]string{"bound": what, "uid": strconv.Itoa(uid)})
}

// tap counts a call in before gRPC reads its request; the call is counted
// out when its context ends (gRPC cancels it when the call ends, however).
func (in *Intake) tap(ctx context.Context, _ *tap.Info) (context.Context, error) {
	if err := allowed(ctx); err != nil {
		return nil, err // refused peers are told before anything of theirs is read
	}
	uid, info := uidOf(ctx)
	in.mu.Lock()
	defer in.mu.Unlock()
	if info != nil && in.over[info.ID] {
		in.refused("connections")
		return nil, exhausted("connections", in.lim.Conns, &in.conns, uid)
	}
	if !in.calls.take(uid, in.lim.Calls) {
		in.refused("calls")
		return nil, exhausted("calls", in.lim.Calls, &in.calls, uid)
	}
	context.AfterFunc(ctx, func() {
		in.mu.Lock()
		defer in.mu.Unlock()
		in.calls.give(uid)
	})
	return ctx, nil
}

func (in *Intake) refused(bound string) {
	if in.Refused != nil {
		in.Refused(bound)
	}
}

// Held returns the connections and calls held now.
func (in *Intake) Held() (conns, calls int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.conns.total, in.calls.total
}

// read holds a reading slot (within the uid's share) while fn reads a
// request.
func (in *Intake) read(ctx context.Context, fn func() error) error {
	uid, _ := uidOf(ctx)
	in.mu.Lock()
	for !in.reading.take(uid, in.lim.Requests) {
		in.waiting++
		freed := in.freed
		in.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			in.mu.Lock()
			in.waiting--
			in.mu.Unlock()
			return status.FromContextError(ctx.Err()).Err()
		}
		in.mu.Lock()
		in.waiting--
	}
	in.mu.Unlock()
	defer in.doneReading(uid)
	return fn()
}

// doneReading frees uid's slot and wakes the requests waiting for one, if
// any.
func (in *Intake) doneReading(uid int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.reading.give(uid)
	if in.waiting > 0 {
		close(in.freed)
		in.freed = make(chan struct{})
	}
}

// streamInterceptor reads each message of a stream through a slot.
func (in *Intake) streamInterceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	return h(srv, &slottedStream{ServerStream: ss, in: in})
}

type slottedStream struct {
	grpc.ServerStream
	in *Intake
}

func (s *slottedStream) RecvMsg(m any) error {
	return s.in.read(s.Context(), func() error { return s.ServerStream.RecvMsg(m) })
}

// Registrar registers services on r with each unary method reading its
// request through a slot: gRPC reads a unary request inside the method's
// handler, before any interceptor runs, so the slot is taken there.
func (in *Intake) Registrar(r grpc.ServiceRegistrar) grpc.ServiceRegistrar {
	return registrar{r, in}
}

type registrar struct {
	grpc.ServiceRegistrar
	in *Intake
}

func (r registrar) RegisterService(desc *grpc.ServiceDesc, impl any) {
	d := *desc
	d.Methods = make([]grpc.MethodDesc, len(desc.Methods))
	for i, m := range desc.Methods {
		h := m.Handler
		m.Handler = func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
			return h(srv, ctx, func(v any) error { return r.in.read(ctx, func() error { return dec(v) }) }, ic)
		}
		d.Methods[i] = m
	}
	r.ServiceRegistrar.RegisterService(&d, impl)
}

// Listener counts the connections l accepts: past the bound (in total or
// for the uid) a connection's calls are refused with RESOURCE_EXHAUSTED,
// and past twice the bound it is closed at once. l is a peercred
// listener made with Closed as its onClose, which counts them out.
func (in *Intake) Listener(l net.Listener) net.Listener { return &intakeListener{Listener: l, in: in} }

type intakeListener struct {
	net.Listener
	in *Intake
}

func (l *intakeListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		a, ok := c.RemoteAddr().(peercred.Addr)
		if !ok || l.in.admit(a.Info) {
			return c, nil
		}
		c.Close() // Closed counts it out
	}
}

// admit counts a connection in, even past the bound (Closed counts every
// one out); it reports false past twice the bound, where the connection
// is to be closed at once.
func (in *Intake) admit(info *peercred.Info) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.conns.take(info.UID, in.lim.Conns) {
		return true
	}
	in.conns.force(info.UID)
	if in.conns.total > 2*in.lim.Conns {
		in.refused("connections")
		return false
	}
	in.over[info.ID] = true
	return true
}

// Closed counts out a connection the listener admitted: give it to
// peercred.NewListener as its onClose.
func (in *Intake) Closed(info *peercred.Info) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.conns.give(info.UID)
	delete(in.over, info.ID)
}
