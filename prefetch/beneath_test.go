package prefetch

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// What a shard swapped after the listing may become. Each is refused where
// the shard is opened, by the read path (small shards) and the mapped one
// (shards over mapAbove), with ErrNotAllowed naming the shard, and nothing
// outside the dataset's folder is opened: the listing already happened,
// so the refusal can only come from the open.
func TestShardSwappedAfterListingIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name  string
		shard string // the listed shard that is swapped
		size  int
		swap  func(t *testing.T, shard, outside string)
		msg   string
	}{
		{"link-small", "train/a-small.tar", 4 << 10, linkTo("a-small.tar"), "symbolic link"},
		{"link-mapped", "train/b-big.tar", 3 << 20, linkTo("b-big.tar"), "symbolic link"},
		{"folder-link-small", "train/sub/c-small.tar", 4 << 10, folderLink, "symbolic link"},
		{"folder-link-mapped", "train/sub/d-big.tar", 3 << 20, folderLink, "symbolic link"},
		{"fifo-small", "train/a-small.tar", 4 << 10, fifo, "regular file"},
		{"fifo-mapped", "train/b-big.tar", 3 << 20, fifo, "regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, data, outside := swapSetup(t, tc.shard, tc.size)
			if int64(tc.size) > mapAbove != strings.Contains(tc.name, "mapped") {
				t.Fatalf("a %d-byte shard is not read the way %s says (mapAbove %d)", tc.size, tc.name, mapAbove)
			}
			shards, err := ListShards(context.Background(), b, "train/", WebDataset, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			sh := findShard(t, shards, tc.shard)
			watch := watchOpens(t, outside)
			tc.swap(t, filepath.Join(data, tc.shard), outside)

			for what, read := range map[string]func() error{
				"readShard": func() error { _, err := readShard(context.Background(), b, sh, nil); return err },
				"Get":       func() error { rc, err := b.Get(context.Background(), sh.Name, 0, -1); closeIf(rc, err); return err },
				"mapShard":  func() error { _, err := b.mapShard(context.Background(), sh.Name, sh.Size); return err },
			} {
				err := withinAMinute(t, what, read)
				if !errors.Is(err, ErrNotAllowed) || !strings.Contains(err.Error(), tc.shard) || !strings.Contains(err.Error(), tc.msg) {
					t.Fatalf("%s of a shard swapped for a %s: %v", what, tc.name, err)
				}
			}
			if got := watch(); got != "" {
				t.Fatalf("the daemon's reads touched files outside the dataset's folder: %s", got)
			}
			// The watch works: opening the outside file is seen.
			if f, err := os.Open(filepath.Join(outside, "secret.tar")); err == nil {
				f.Close()
			}
			if watch() == "" {
				t.Fatal("the watch on the outside folder saw nothing, not even our own open")
			}
		})
	}
}

// swapSetup makes root/data/train/<shard> (size bytes) among other
// shards, and root/outside/{secret.tar,<shard's base>} of the same size
// (so a followed link would pass every size check); root/data is the one
// allowed folder and the local source.
func swapSetup(t *testing.T, shard string, size int) (*localBackend, string, string) {
	t.Helper()
	root, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data, outside := filepath.Join(root, "data"), filepath.Join(root, "outside")
	writeDataset(t, filepath.Join(data, "train"), 2, 3, 10)
	secret := bytes.Repeat([]byte("SECRET"), size/6+1)[:size]
	for _, p := range []string{filepath.Join(data, shard), filepath.Join(outside, "secret.tar"), filepath.Join(outside, filepath.Base(shard))} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, secret, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	allow, err := newAllowList([]string{data}, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := openLocal(data, allow)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b.(*localBackend), data, outside
}

func findShard(t *testing.T, shards []Shard, name string) Shard {
	t.Helper()
	for _, sh := range shards {
		if sh.Name == name {
			return sh
		}
	}
	t.Fatalf("%s was not listed: %v", name, shards)
	return Shard{}
}

// linkTo replaces the shard with a link to base in the outside folder.
func linkTo(base string) func(t *testing.T, shard, outside string) {
	return func(t *testing.T, shard, outside string) {
		t.Helper()
		replace(t, shard, func(p string) error { return os.Symlink(filepath.Join(outside, base), p) })
	}
}

// folderLink replaces the shard's folder with a link to the outside
// folder, which holds a file of the shard's name and size.
func folderLink(t *testing.T, shard, outside string) {
	t.Helper()
	dir := filepath.Dir(shard)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, dir); err != nil {
		t.Fatal(err)
	}
}

// fifo replaces the shard with a named pipe no one writes to: an open that
// waited for a writer would never return.
func fifo(t *testing.T, shard, _ string) {
	t.Helper()
	replace(t, shard, func(p string) error { return unix.Mkfifo(p, 0o644) })
}

func replace(t *testing.T, p string, with func(string) error) {
	t.Helper()
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := with(p); err != nil {
		t.Fatal(err)
	}
}

func closeIf(c interface{ Close() error }, err error) {
	if err == nil {
		c.Close()
	}
}

// withinAMinute runs read, failing the test if it blocks (on a FIFO); a
// minute is far beyond what an open takes on a loaded machine.
func withinAMinute(t *testing.T, what string, read func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- read() }()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatalf("%s blocked on the swapped shard", what)
		return nil
	}
}

// watchOpens watches dir (and its files) for opens and reads with
// inotify; the function it returns says what was seen since the last
// call ("" for nothing). Events are queued by the open itself, so once a
// read returned, its events are there.
func watchOpens(t *testing.T, dir string) func() string {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_OPEN|unix.IN_ACCESS); err != nil {
		t.Fatal(err)
	}
	return func() string {
		var seen []string
		buf := make([]byte, 64<<10)
		for {
			n, err := unix.Read(fd, buf)
			if errors.Is(err, syscall.EAGAIN) {
				return strings.Join(seen, ", ")
			}
			if err != nil {
				t.Fatal(err)
			}
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)]), "\x00")
				seen = append(seen, filepath.Join(dir, name))
				off += unix.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}
}

// The second layer: a dataset's folder moved out of the allowed one after
// the session opened it is still read beneath its descriptor, but where
// the shard really is now is outside, and it is refused.
func TestShardOfAMovedFolderIsRefused(t *testing.T) {
	b, data, _ := swapSetup(t, "train/a-small.tar", 4<<10)
	shards, err := ListShards(context.Background(), b, "train/", WebDataset, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	sh := findShard(t, shards, "train/a-small.tar")
	moved := filepath.Join(filepath.Dir(data), "moved")
	if err := os.Rename(data, moved); err != nil {
		t.Fatal(err)
	}
	_, err = readShard(context.Background(), b, sh, nil)
	if !errors.Is(err, ErrNotAllowed) || !strings.Contains(err.Error(), "train/a-small.tar") || !strings.Contains(err.Error(), moved) {
		t.Fatalf("a shard of a folder moved out of the allowed one: %v", err)
	}
}
