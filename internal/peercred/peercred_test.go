package peercred

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
)

func TestPolicy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		p      Policy
		peer   Info
		refuse string // substring of the refusal, "" when allowed
	}{
		{"owner", Policy{UID: 1000, GID: -1}, Info{UID: 1000, GID: 1000}, ""},
		{"root", Policy{UID: 1000, GID: -1}, Info{UID: 0, GID: 0}, ""},
		{"stranger", Policy{UID: 1000, GID: -1}, Info{UID: 1001, GID: 1001, PID: 7}, "uid 1001 (pid 7)"},
		{"stranger, no group", Policy{UID: 1000, GID: -1}, Info{UID: 1001, GID: 1001}, "--socket-group"},
		{"primary group", Policy{UID: 1000, GID: 50}, Info{UID: 1001, GID: 50}, ""},
		{"supplementary group", Policy{UID: 1000, GID: 50}, Info{UID: 1001, GID: 1001, Groups: []int{20, 50}}, ""},
		{"not a member", Policy{UID: 1000, GID: 50}, Info{UID: 1001, GID: 1001, Groups: []int{20}}, "member of its --socket-group (gid 50)"},
	} {
		got := tc.p.check(&tc.peer)
		if tc.refuse == "" && got != "" || tc.refuse != "" && !strings.Contains(got, tc.refuse) {
			t.Errorf("%s: check = %q, want refusal containing %q", tc.name, got, tc.refuse)
		}
	}
}

// A real connection carries the peer's credentials and reports its end.
func TestListenerCredentialsAndClose(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan *Info, 1)
	l := NewListener(ul, Policy{UID: os.Getuid(), GID: -1}, func(i *Info) { closed <- i }, nil)
	defer l.Close()

	client, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	info := c.RemoteAddr().(Addr).Info
	if info.UID != os.Getuid() || info.PID != os.Getpid() || !info.Allowed() || len(info.ID) != 32 {
		t.Fatalf("info = %+v; want our uid %d and pid %d, allowed, a 32-hex id", info, os.Getuid(), os.Getpid())
	}
	if info.Groups == nil {
		t.Errorf("no supplementary groups read (SO_PEERGROUPS)")
	}

	// A second connection gets another id.
	client2, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer client2.Close()
	c2, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if c2.RemoteAddr().(Addr).Info.ID == info.ID {
		t.Fatal("two connections share an id")
	}

	client.Close()
	select {
	case <-info.Done():
		t.Fatal("Done closed before the server side closed the connection")
	default:
	}
	c.Close()
	c.Close() // idempotent: onClose runs once
	select {
	case got := <-closed:
		if got != info {
			t.Fatal("onClose got another connection's info")
		}
	case <-time.After(testtime.Scale(30 * time.Second)):
		t.Fatal("onClose not called")
	}
	select {
	case <-info.Done():
	default:
		t.Fatal("Done not closed")
	}
	if len(closed) != 0 {
		t.Fatal("onClose ran twice")
	}
}
