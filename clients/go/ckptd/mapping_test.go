package ckptd

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// arenaOnly answers GetArena the way a daemon that has just restarted
// would: with its new arena, whatever lease the client holds.
type arenaOnly struct {
	pb.UnimplementedCheckpointServer
	path string
	id   string
}

func (s *arenaOnly) GetArena(context.Context, *pb.GetArenaRequest) (*pb.ArenaInfo, error) {
	return &pb.ArenaInfo{Path: s.path, Size: 1 << 16, Id: s.id}, nil
}

// A lease granted by a daemon that restarted before the client mapped its
// arena is refused (the client would copy into the new daemon's arena at
// offsets it never granted), as a daemon-unavailable error that Save and
// Load start over on; a lease of the arena served now maps.
func TestLeaseOfAnotherArenaRefused(t *testing.T) {
	dir := t.TempDir()
	arenaPath := filepath.Join(dir, "arena")
	if err := os.WriteFile(arenaPath, make([]byte, 1<<16), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "ckptd.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterCheckpointServer(srv, &arenaOnly{path: arenaPath, id: "new"})
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	c, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	_, err = c.region(ctx, &pb.Lease{Id: "l1", Offset: 0, Length: 4096, ArenaId: "old"})
	if !errors.Is(err, ErrDaemonUnavailable) || !errors.Is(err, errArenaMoved) {
		t.Fatalf("a lease of the old arena: %v", err)
	}
	mem, err := c.region(ctx, &pb.Lease{Id: "l2", Offset: 4096, Length: 4096, ArenaId: "new"})
	if err != nil || len(mem) != 4096 {
		t.Fatalf("a lease of the current arena: %d bytes, %v", len(mem), err)
	}
	calls := 0
	_, err = retryMoved(func() (int, error) { calls++; return 0, errArenaMoved })
	if calls != arenaRetries || !errors.Is(err, errArenaMoved) {
		t.Fatalf("retryMoved: %d calls, %v", calls, err)
	}
}
