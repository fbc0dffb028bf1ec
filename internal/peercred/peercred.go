// Package peercred knows who is on the other end of each connection to the
// daemon's unix socket. It wraps the listener: every accepted connection
// gets a random id and the peer's credentials from the kernel (SO_PEERCRED
// and SO_PEERGROUPS, which a client cannot forge), is checked against a
// Policy, and signals when it closes, so that what a client created (save
// leases, restore regions, dataset sessions) can be released the moment
// the client goes away instead of after a timeout.
//
// gRPC sees the credentials as the connection's peer address:
// FromContext returns them to handlers, and the interceptors refuse the
// calls of peers the policy does not allow, with PERMISSION_DENIED naming
// the uid and the fix.
package peercred

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
	grpcpeer "google.golang.org/grpc/peer"
)

// Info is one connection: its id and its peer's credentials.
type Info struct {
	ID     string // 128 random bits, hex
	UID    int
	GID    int
	PID    int
	Groups []int // supplementary groups; nil where the kernel cannot say
	// Refused says why the policy refuses this peer ("" when allowed).
	Refused string
	done    chan struct{}
	start   uint64 // the peer process's start time, see Exited; 0 if unknown
}

// Done is closed when the connection closes.
func (i *Info) Done() <-chan struct{} { return i.done }

// Allowed reports whether the policy lets this peer make calls.
func (i *Info) Allowed() bool { return i.Refused == "" }

// Policy says who may use the daemon: its own user, root, and the members
// of one group.
type Policy struct {
	UID int // the daemon's uid
	GID int // --socket-group, or -1
}

// check returns why c may not use the daemon, or "".
func (p Policy) check(c *Info) string {
	if c.UID == p.UID || c.UID == 0 {
		return ""
	}
	if p.GID >= 0 && (c.GID == p.GID || slices.Contains(c.Groups, p.GID)) {
		return ""
	}
	if p.GID >= 0 {
		return fmt.Sprintf("uid %d (pid %d) is neither the daemon's user (uid %d) nor root nor a member of its --socket-group (gid %d); "+
			"add the user to that group", c.UID, c.PID, p.UID, p.GID)
	}
	return fmt.Sprintf("uid %d (pid %d) is neither the daemon's user (uid %d) nor root; "+
		"to let other users in, start ckptd serve with --socket-group naming a group they share", c.UID, c.PID, p.UID)
}

// UnixListener is what a Listener wraps: *net.UnixListener, or a type
// that embeds one.
type UnixListener interface {
	net.Listener
	AcceptUnix() (*net.UnixConn, error)
}

// Listener accepts unix connections and tags each with its Info.
type Listener struct {
	UnixListener
	policy  Policy
	onClose func(*Info)
	log     *slog.Logger
}

// NewListener wraps l. onClose (may be nil) runs once per connection,
// after its Done channel is closed, when the connection closes for any
// reason; it must not block for long.
func NewListener(l UnixListener, p Policy, onClose func(*Info), log *slog.Logger) *Listener {
	if log == nil {
		log = slog.Default()
	}
	return &Listener{UnixListener: l, policy: p, onClose: onClose, log: log}
}

// Accept implements net.Listener.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return nil, err
		}
		info, err := credentials(c)
		if err != nil {
			// Without credentials nobody can say who this is: drop it.
			l.log.Warn("dropping a connection whose peer credentials cannot be read", "err", err)
			c.Close()
			continue
		}
		if info.Refused = l.policy.check(info); info.Refused != "" {
			l.log.Warn("refusing a client", "uid", info.UID, "gid", info.GID, "pid", info.PID, "why", info.Refused)
		}
		return &conn{UnixConn: c, info: info, onClose: l.onClose}, nil
	}
}

// credentials reads the peer's credentials off a fresh connection.
func credentials(c *net.UnixConn) (*Info, error) {
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		return nil, err
	}
	info := &Info{ID: hex.EncodeToString(id), done: make(chan struct{})}
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var serr error
	err = rc.Control(func(fd uintptr) {
		var cred *unix.Ucred
		if cred, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); serr != nil {
			return
		}
		info.UID, info.GID, info.PID = int(cred.Uid), int(cred.Gid), int(cred.Pid)
		info.Groups = peerGroups(int(fd))
	})
	if err == nil {
		err = serr
	}
	if info.PID > 0 {
		_, info.start, _ = procStat(info.PID)
	}
	return info, err
}

// conn is an accepted connection that knows its peer and reports its end.
type conn struct {
	*net.UnixConn
	info    *Info
	onClose func(*Info)
	once    sync.Once
}

// RemoteAddr carries the Info to gRPC, which hands it to handlers as the
// peer's address.
func (c *conn) RemoteAddr() net.Addr { return Addr{c.info} }

func (c *conn) Close() error {
	err := c.UnixConn.Close()
	c.once.Do(func() {
		close(c.info.done)
		if c.onClose != nil {
			c.onClose(c.info)
		}
	})
	return err
}

// Addr is the peer address of a connection from a Listener.
type Addr struct{ Info *Info }

func (Addr) Network() string { return "unix" }
func (a Addr) String() string {
	return fmt.Sprintf("uid=%d,pid=%d,conn=%s", a.Info.UID, a.Info.PID, a.Info.ID)
}

// FromContext returns the connection of a gRPC call, when it came through
// a Listener.
func FromContext(ctx context.Context) (*Info, bool) {
	p, ok := grpcpeer.FromContext(ctx)
	if !ok {
		return nil, false
	}
	a, ok := p.Addr.(Addr)
	if !ok {
		return nil, false
	}
	return a.Info, true
}
