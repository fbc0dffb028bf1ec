package peers

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"google.golang.org/grpc/credentials/insecure"
)

// A peer file is read sorted, without comments and blank lines; this
// sidecar is found by its address and port; a bad line is refused with
// its number; a change is picked up by Watch.
func TestPeerFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "peers")
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("# the job's sidecars\n10.0.0.2:7465\n\n127.0.0.1:7465  # this one\n10.0.0.1:7465\n")
	d := Discovery{File: path, Port: "7465", Every: 10 * time.Millisecond}
	list, self, err := d.Lookup(context.Background())
	if err != nil || !slices.Equal(list, []string{"10.0.0.1:7465", "10.0.0.2:7465", "127.0.0.1:7465"}) || self != "127.0.0.1:7465" {
		t.Fatalf("Lookup = %v %q %v", list, self, err)
	}
	if _, self, _ := (Discovery{File: path, Port: "9999"}).Lookup(context.Background()); self != "" {
		t.Fatalf("found itself on another port: %q", self)
	}
	if _, self, _ := (Discovery{File: path, Self: "10.0.0.2:7465"}).Lookup(context.Background()); self != "10.0.0.2:7465" {
		t.Fatalf("advertised self: %q", self)
	}
	host, _ := os.Hostname()
	named := filepath.Join(t.TempDir(), "named")
	if err := os.WriteFile(named, []byte("node-a:7465\n"+host+":7465\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, self, _ := (Discovery{File: named, Port: "7465"}).Lookup(context.Background()); self != host+":7465" {
		t.Fatalf("found itself by host name as %q", self)
	}

	c := NewClient(list, self, 1, Creds{GRPC: insecure.NewCredentials()}, slog.Default())
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.Watch(ctx, d, slog.Default()); close(done) }()
	write("127.0.0.1:7465\n10.0.0.3:7465\n")
	testtime.Until(t, 30*time.Second, "Watch picks the new list up", func() bool {
		l, _ := c.Members()
		return slices.Equal(l, []string{"10.0.0.3:7465", "127.0.0.1:7465"})
	})
	write("not an address\n") // a bad file keeps the last list
	time.Sleep(50 * time.Millisecond)
	if l, _ := c.Members(); len(l) != 2 {
		t.Fatalf("a bad file replaced the list: %v", l)
	}
	cancel()
	<-done

	if _, _, err := d.Lookup(context.Background()); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("bad line: %v", err)
	}
}

// A DNS name gives every address it resolves to, with the port.
func TestPeerDNS(t *testing.T) {
	list, self, err := Discovery{DNS: "localhost:7465", Port: "7465"}.Lookup(context.Background())
	if err != nil || !slices.Contains(list, "127.0.0.1:7465") || self == "" {
		t.Fatalf("localhost: %v %q %v", list, self, err)
	}
	if _, _, err := (Discovery{DNS: "localhost"}).Lookup(context.Background()); err == nil {
		t.Fatal("a name without a port was taken")
	}
}

func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:7465": true, "127.3.2.1:1": true, "[::1]:7465": true, "localhost:7465": true,
		":7465": false, "0.0.0.0:7465": false, "10.0.0.1:7465": false, "[::]:7465": false, "node1:7465": false, "nonsense": false,
	} {
		if got := Loopback(addr); got != want {
			t.Errorf("Loopback(%q) = %v, want %v", addr, got, want)
		}
	}
}
