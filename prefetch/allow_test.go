package prefetch

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

// allowSetup makes root/{data,database,outside} (each a dataset), an arena
// in root/shm/arena, and a service allowing root/data, root/shm and
// s3://bkt/train.
func allowSetup(t *testing.T) (*Service, string) {
	t.Helper()
	root, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"data", "database", "outside"} {
		writeDataset(t, filepath.Join(root, d), 2, 3, 10)
	}
	s3 := posixDataset(t, 1, 2, 10)
	s := newService(t, nil, ServiceConfig{
		Allow:    []string{filepath.Join(root, "data"), filepath.Join(root, "shm"), "s3://bkt/train/"},
		ArenaDir: filepath.Join(root, "shm", "arena"),
		Open:     func(context.Context, string) (storage.Backend, error) { return nopClose{s3}, nil },
	})
	return s, root
}

func openSrc(s *Service, source string) error {
	id, _, err := s.OpenSession(context.Background(), Owner{}, source, Spec{BatchSize: 100, WorldSize: 1})
	if err == nil {
		_ = s.CloseSession(Owner{}, id)
	}
	return err
}

func TestAllowedSources(t *testing.T) {
	s, root := allowSetup(t)
	data := filepath.Join(root, "data")
	if err := os.Symlink(data, filepath.Join(root, "link-to-data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(root, "outside"), filepath.Join(data, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(data, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeDataset(t, filepath.Join(data, "sub", "ds"), 1, 2, 10)
	for _, tc := range []struct {
		source string
		want   error // nil: allowed
		msg    string
	}{
		{data, nil, ""},
		{"file://" + data, nil, ""},
		{data + "/sub/ds", nil, ""},
		{data + "/sub/../sub/ds", nil, ""},
		{filepath.Join(root, "link-to-data"), nil, ""}, // a link to an allowed folder: its real path counts
		{"s3://bkt/train", nil, ""},
		{"s3://bkt/train/part-1", nil, ""},
		{filepath.Join(root, "outside"), ErrNotAllowed, "not beneath any source the daemon allows"},
		{filepath.Join(root, "database"), ErrNotAllowed, "not beneath"}, // component-wise: /data does not allow /database
		{data + "/../outside", ErrNotAllowed, "not beneath"},
		{data + "/sub/../../outside", ErrNotAllowed, "not beneath"},
		{data + "/escape", ErrNotAllowed, "really " + filepath.Join(root, "outside")},
		{"/", ErrNotAllowed, ""},
		{filepath.Join(root, "shm", "arena"), ErrNotAllowed, "arena folder"},
		{filepath.Join(root, "shm", "arena", "journal"), ErrNotAllowed, "arena folder"},
		{filepath.Join(root, "shm"), ErrNotAllowed, "arena folder"}, // holds it
		{filepath.Join(root, "shm", "arena", "..", "arena"), ErrNotAllowed, "arena folder"},
		{filepath.Join(data, "missing"), ErrInvalid, "no such folder"},
		{filepath.Join(root, "outside", "missing"), ErrNotAllowed, "not beneath"}, // no hint of what exists outside
		{filepath.Join(data, "escape", "missing"), ErrNotAllowed, "not beneath"},
		{"s3://other/train", ErrNotAllowed, "not beneath"},
		{"s3://bkt/trainer", ErrNotAllowed, "not beneath"},
		{"s3://bkt", ErrNotAllowed, "not beneath"},
		{"s3://bkt/train/../secret", ErrInvalid, `".."`},
		{"s3://bkt/train/%2e%2e/secret", ErrInvalid, `".."`},
		{"s3://bkt/train//x", ErrInvalid, "empty"},
		{"s3://key:secret@bkt/train", ErrInvalid, "credentials"},
		{"ftp://bkt/train", ErrInvalid, `unsupported scheme "ftp"`},
		{"relative/path", ErrInvalid, "absolute"},
	} {
		err := openSrc(s, tc.source)
		if tc.want == nil && err != nil || tc.want != nil && (!errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg)) {
			t.Errorf("%s: %v; want %v %q", tc.source, err, tc.want, tc.msg)
		}
	}
	if strings.Contains(openSrc(s, "s3://key:secret@bkt/train").Error(), "secret") {
		t.Error("the error repeats the credentials of the URL")
	}
}

func TestNoSourcesAllowed(t *testing.T) {
	s := newService(t, nil, ServiceConfig{Allow: []string{}})
	err := openSrc(s, t.TempDir())
	if !errors.Is(err, ErrNotAllowed) || !strings.Contains(err.Error(), "allows no dataset sources") || !ranInto(err, budget.DatasetSources) {
		t.Fatalf("with no --dataset-allow: %v", err)
	}
	if _, err := newAllowList([]string{"relative"}, nil); err == nil || !ranInto(err, budget.DatasetSources) {
		t.Fatalf("a relative --dataset-allow entry: %v", err)
	}
}

// A shard that is a link out of the allowed folder is never read: the
// listing skips links (so this passes without an open ever meeting one),
// and a link swapped in after the listing is refused where it is opened,
// naming it (TestShardSwappedAfterListingIsRefused).
func TestShardLinkedOutsideIsRefused(t *testing.T) {
	s, root := allowSetup(t)
	data := filepath.Join(root, "data")
	secret := filepath.Join(root, "outside", "shard-000.tar")
	if err := os.Symlink(secret, filepath.Join(data, "zz-secret.tar")); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	id, _, err := s.OpenSession(ctx, Owner{}, data, Spec{BatchSize: 1, WorldSize: 1, ShuffleWindow: 1, SkipCorrupt: true})
	if err != nil {
		t.Fatal(err)
	}
	var release []string
	samples := 0
	for {
		d, lease, _, err := s.Next(ctx, Owner{}, id, release)
		if errors.Is(err, io.EOF) {
			// A store that does not even list links (the POSIX backend
			// skips them) delivers the folder's own 2 x 3 samples only.
			if samples != 6 {
				t.Fatalf("the epoch delivered %d samples: it read a shard linked from outside the allowed folder", samples)
			}
			break
		}
		if err == nil {
			samples += len(d.Samples)
		}
		if err != nil {
			if !errors.Is(err, ErrNotAllowed) || !strings.Contains(err.Error(), "zz-secret.tar") || !strings.Contains(err.Error(), secret) {
				t.Fatalf("a shard linked from outside: %v", err)
			}
			break
		}
		release = []string{lease}
	}
	// A link to a shard inside the allowed folder is fine.
	if err := os.Remove(filepath.Join(data, "zz-secret.tar")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(data, "shard-000.tar"), filepath.Join(data, "zz-again.tar")); err != nil {
		t.Fatal(err)
	}
	if err := openSrc(s, data); err != nil {
		t.Fatal(err)
	}
}
