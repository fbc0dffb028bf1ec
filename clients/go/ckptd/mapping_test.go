//go:build linux

package ckptd

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// arenaOnly answers GetArena the way a daemon that has just restarted
// would: with its new arena, whatever lease the client holds.
type arenaOnly struct {
	pb.UnimplementedCheckpointServer
	path string
	id   string
	hot  *pb.MappedFile
}

func (s *arenaOnly) GetArena(context.Context, *pb.GetArenaRequest) (*pb.ArenaInfo, error) {
	return &pb.ArenaInfo{Path: s.path, Size: 1 << 16, Id: s.id, Hot: s.hot}, nil
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

// An arena the client cannot be sure the daemon made is never mapped, so
// no save is copied into it: a link (to a file of the victim's), a file
// of another user, one others may write, one in a folder others may
// write. The daemon (in this process) is trusted, so only the arena's
// checks stand between the client and the file.
func TestUntrustedArenaRefused(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, dir, arena, victim string)
		msg   string
	}{
		{"symlink", func(t *testing.T, _, arena, victim string) { must(t, os.Symlink(victim, arena)) }, "symbolic link"},
		{"another-uid", func(t *testing.T, _, arena, _ string) {
			if os.Geteuid() != 0 {
				t.Skip("needs root to give the arena to another user")
			}
			writeArena(t, arena, 0o600)
			must(t, os.Chown(arena, 65534, 65534))
		}, "uid 65534"},
		{"world-writable", func(t *testing.T, _, arena, _ string) { writeArena(t, arena, 0o666) }, "mode 666"},
		{"folder-writable-by-others", func(t *testing.T, dir, arena, _ string) {
			writeArena(t, arena, 0o600)
			must(t, os.Chmod(dir, 0o777))
		}, "mode 777"},
		{"folder-writable-by-others-sticky", func(t *testing.T, dir, arena, _ string) {
			writeArena(t, arena, 0o600)
			must(t, os.Chmod(dir, os.ModeSticky|0o777))
		}, "mode 1777"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "shm")
			must(t, os.Mkdir(dir, 0o700))
			arena, victim := filepath.Join(dir, "arena"), filepath.Join(t.TempDir(), "victim")
			writeArena(t, victim, 0o600)
			tc.setup(t, dir, arena, victim)
			before := snapshotFiles(t, arena, victim)

			c := arenaClient(t, arena)
			mem, err := c.region(context.Background(), &pb.Lease{Id: "l1", Offset: 0, Length: 4096, ArenaId: "a"})
			if mem != nil || !refusedArena(err) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("an arena that is a %s: %d bytes, %v", tc.name, len(mem), err)
			}
			if after := snapshotFiles(t, arena, victim); after != before {
				t.Fatalf("the refused arena changed:\n%s\nnow:\n%s", before, after)
			}
		})
	}
	t.Run("trusted", func(t *testing.T) { // the same set-up, made right, maps
		dir := filepath.Join(t.TempDir(), "shm")
		must(t, os.Mkdir(dir, 0o750))
		arena := filepath.Join(dir, "arena")
		writeArena(t, arena, 0o640)
		mem, err := arenaClient(t, arena).region(context.Background(), &pb.Lease{Id: "l1", Offset: 0, Length: 4096, ArenaId: "a"})
		if err != nil || len(mem) != 4096 {
			t.Fatalf("a trusted arena: %d bytes, %v", len(mem), err)
		}
	})
}

// refusedArena: the client refused the arena as not the daemon's.
func refusedArena(err error) bool {
	return errors.Is(err, ErrUntrustedDaemon)
}

// arenaClient is a client of an in-process daemon whose arena is path.
func arenaClient(t *testing.T, path string) *Client {
	t.Helper()
	return arenaClientHot(t, &arenaOnly{path: path, id: "a"})
}

// arenaClientHot is a client of the in-process daemon srv.
func arenaClientHot(t *testing.T, daemon *arenaOnly) *Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "ckptd.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterCheckpointServer(srv, daemon)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	c, err := Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// writeArena writes an arena file of arenaOnly's size, filled with a
// pattern a copy into it would change.
func writeArena(t *testing.T, p string, mode os.FileMode) {
	t.Helper()
	must(t, os.WriteFile(p, bytes.Repeat([]byte{0xa5}, 1<<16), mode))
	must(t, os.Chmod(p, mode)) // whatever the umask
}

// snapshotFiles describes files by mode, owner and contents.
func snapshotFiles(t *testing.T, paths ...string) string {
	t.Helper()
	var out strings.Builder
	for _, p := range paths {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		data, _ := os.ReadFile(p)
		fmt.Fprintf(&out, "%s mode %o uid %d sha256 %x\n", p, st.Mode, st.Uid, sha256.Sum256(data))
	}
	return out.String()
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// A lease of the hot tier's file (a restore in place) reads that file,
// mapped read-only, once it is the file the daemon's id names; a file
// made anew since is refused as a restart, and one that cannot be mapped
// turns restores in place off for the client, which then copies.
func TestLeaseOfTheHotFile(t *testing.T) {
	dir := t.TempDir()
	arenaPath, hotPath := filepath.Join(dir, "arena"), filepath.Join(dir, "hot")
	writeArena(t, arenaPath, 0o600)
	hot := bytes.Repeat([]byte("hot tier"), 1<<10)
	must(t, os.WriteFile(hotPath, hot, 0o600))
	var st unix.Stat_t
	must(t, unix.Stat(hotPath, &st))
	ident := fmt.Sprintf("%d:%d", st.Dev, st.Ino)
	ctx := context.Background()
	for _, tc := range []struct {
		name, path, id string
		want           error
	}{
		{"the daemon's file", hotPath, ident + ":n1", nil},
		{"a file made anew", hotPath, "1:2:n1", errArenaMoved},
		{"a file that cannot be mapped", filepath.Join(dir, "gone"), ident + ":n1", errNotInPlace},
	} {
		daemon := &arenaOnly{path: arenaPath, id: "a", hot: &pb.MappedFile{Path: tc.path, Size: uint64(len(hot)), Id: tc.id}}
		c := arenaClientHot(t, daemon)
		if !c.canReadInPlace(ctx) {
			t.Fatalf("%s: a daemon with a hot tier file is not asked for restores in place", tc.name)
		}
		mem, err := c.region(ctx, &pb.Lease{Id: "l", Offset: 8, Length: 16, ArenaId: tc.id})
		if tc.want == nil {
			if err != nil || !bytes.Equal(mem, hot[8:24]) {
				t.Fatalf("%s: %q, %v", tc.name, mem, err)
			}
			continue
		}
		if !errors.Is(err, tc.want) {
			t.Fatalf("%s: %v, want %v", tc.name, err, tc.want)
		}
		if again := c.canReadInPlace(ctx); again != (tc.want != errNotInPlace) {
			t.Fatalf("%s: restores in place asked for after: %v", tc.name, again)
		}
	}
}
