package peers

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/internal/peers/peertest"
	"github.com/ckptd/ckptd/internal/testtime"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// A rank's holders depend on the rank and the list only; a reader on any
// other node asks a superset of where the sender sent.
func TestPlacement(t *testing.T) {
	list := []string{"c:1", "a:1", "d:1", "b:1"}
	for _, tc := range []struct {
		self     string
		rank     int
		replicas int
		want     []string
	}{
		{"a:1", 0, 1, []string{"b:1"}},
		{"b:1", 0, 1, []string{"c:1"}},        // the holder itself sends on
		{"a:1", 3, 2, []string{"b:1", "c:1"}}, // wraps around, skipping self
		{"c:1", 5, 2, []string{"d:1", "a:1"}},
	} {
		if got := Holders(list, tc.self, tc.rank, tc.replicas); !slices.Equal(got, tc.want) {
			t.Errorf("Holders(%s, rank %d, %d) = %v, want %v", tc.self, tc.rank, tc.replicas, got, tc.want)
		}
	}
	for rank := range 8 {
		for _, sender := range list {
			sent := Holders(list, sender, rank, 2)
			for _, reader := range list {
				asked := append(candidates(list, reader, rank, 2), reader) // a reader has its own hot tier too
				for _, h := range sent {
					if !slices.Contains(asked, h) {
						t.Fatalf("rank %d: %s sent to %s, which %s never asks (%v)", rank, sender, h, reader, asked)
					}
				}
			}
		}
	}
}

// The peers' service takes only clients with a certificate its CA signed,
// and plaintext only when asked for.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, other := peertest.NewCA(t, dir, "ca"), peertest.NewCA(t, dir, "other-ca")
	cert, key := ca.Leaf(t, dir, "node")
	badCert, badKey := other.Leaf(t, dir, "stranger")
	serverCreds, _, err := TLS{CertFile: cert, KeyFile: key, CAFile: ca.File}.Credentials()
	if err != nil {
		t.Fatal(err)
	}
	members := NewClient(nil, "", 1, Creds{}, nil)
	addr, stop, err := Listen("127.0.0.1:0", serverCreds, NewServer(nil, 1<<20).Members(members))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	members.SetMembers([]string{addr, "127.0.0.1:1"}, addr) // the certificate's 127.0.0.1 is a peer
	call := func(tl TLS) error {
		_, creds, err := tl.Credentials()
		if err != nil {
			return err
		}
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds.GRPC))
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), testtime.Scale(30*time.Second))
		defer cancel()
		// A replica larger than the server takes: refused after the handshake.
		stream, err := pb.NewPeerClient(cc).PutReplica(ctx)
		if err != nil {
			return err
		}
		_ = stream.Send(&pb.ReplicaPiece{Header: &pb.ReplicaHeader{DataSize: 1 << 30}})
		_, err = stream.CloseAndRecv()
		return err
	}
	if err := call(TLS{CertFile: cert, KeyFile: key, CAFile: ca.File}); err == nil || !strings.Contains(err.Error(), "more than this sidecar takes") {
		t.Fatalf("a peer of the CA: %v (want the size refusal, past the handshake)", err)
	}
	if err := call(TLS{CertFile: badCert, KeyFile: badKey, CAFile: ca.File}); err == nil || strings.Contains(err.Error(), "more than this sidecar takes") {
		t.Fatalf("a certificate of another CA was let in: %v", err)
	}
	if err := call(TLS{Insecure: true}); err == nil || strings.Contains(err.Error(), "more than this sidecar takes") {
		t.Fatalf("plaintext was let in: %v", err)
	}
	for name, tl := range map[string]TLS{"another CA": {CertFile: badCert, KeyFile: badKey, CAFile: ca.File}, "plaintext": {Insecure: true}} {
		_, creds, err := tl.Credentials()
		if err != nil {
			t.Fatal(err)
		}
		c := NewClient(nil, "", 1, creds, slog.Default())
		if err := c.raw(context.Background(), addr, &pb.GetReplicaRequest{Job: "j"}, func(*pb.ReplicaHeader, io.Reader) error { return nil }); err == nil {
			t.Fatalf("%s: the raw data path answered", name)
		}
	}
	if _, _, err := (TLS{}).Credentials(); err == nil || !strings.Contains(err.Error(), "--peer-insecure") {
		t.Fatalf("no TLS and no --peer-insecure: %v", err)
	}
}

// A sidecar alone in its peer list (a discovered list while pods start)
// makes no copy, and says so: a save must not end replicated.
func TestReplicateAloneIsAnError(t *testing.T) {
	c := NewClient([]string{"127.0.0.1:1"}, "127.0.0.1:1", 1, Creds{}, slog.New(slog.DiscardHandler))
	m := &checkpoint.Manifest{Job: "j", Step: 1, Rank: 0, WorldSize: 1, Attempt: "a"}
	err := c.Replicate(t.Context(), m, nil, false, true)
	if err == nil || !strings.Contains(err.Error(), "fewer than the 1 replicas") {
		t.Fatalf("replicating with no other sidecar: %v", err)
	}
}
