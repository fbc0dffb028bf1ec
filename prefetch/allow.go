package prefetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

// ErrNotAllowed: a dataset source (or a shard in it) lies outside every
// --dataset-allow entry, or is the daemon's own arena; the daemon answers
// PERMISSION_DENIED. The daemon reads sources with its own identity, so
// which ones trainers may name is the operator's decision, and nothing is
// allowed unless listed.
var ErrNotAllowed = errors.New("dataset source not allowed")

// allowList is serve's --dataset-allow: local folders and S3 bucket
// prefixes trainers may read datasets from, and the folders that may never
// be read (the arena, whose folder holds the journal of staged saves).
//
// A local source is allowed when its real path (symbolic links resolved)
// lies beneath the real path of an allowed folder, component by component
// (/data allows /data/x, not /database). A shard is opened beneath its
// source's folder without following links, and its real path is checked
// again on the descriptor opened (localBackend.open). An S3 source is
// allowed when its bucket is an allowed one and its key prefix lies
// beneath the allowed prefix, component by component.
type allowList struct {
	local   []string // cleaned absolute paths, resolved at each check
	s3      []s3Prefix
	exclude []string // real paths
}

type s3Prefix struct{ bucket, prefix string } // prefix without leading or trailing "/"; "" is the whole bucket

// newAllowList parses the entries of --dataset-allow; exclude names folders
// never allowed (they must exist).
func newAllowList(entries, exclude []string) (*allowList, error) {
	l := &allowList{}
	for _, e := range entries {
		if e = strings.TrimSpace(e); e == "" {
			continue
		}
		src, err := parseSource(e)
		if err != nil {
			return nil, budget.Wrap(fmt.Errorf("allowed dataset source %q: %w", e, err), budget.DatasetSources)
		}
		if src.path != "" {
			l.local = append(l.local, src.path)
		} else {
			l.s3 = append(l.s3, src.s3)
		}
	}
	for _, dir := range exclude {
		real, err := filepath.EvalSymlinks(dir)
		if err != nil {
			return nil, fmt.Errorf("dataset sources: the folder to exclude: %w", err)
		}
		l.exclude = append(l.exclude, real)
	}
	return l, nil
}

// parsedSource is a source as named: a local path or an S3 prefix.
type parsedSource struct {
	path string // cleaned absolute path, or ""
	s3   s3Prefix
}

// parseSource reads a folder path, file:///path or s3://bucket/prefix.
func parseSource(raw string) (parsedSource, error) {
	scheme, rest, ok := strings.Cut(raw, ":")
	if !ok || strings.ContainsAny(scheme, "/") || !strings.HasPrefix(rest, "//") && !strings.EqualFold(scheme, "file") && !strings.EqualFold(scheme, "s3") {
		if !filepath.IsAbs(raw) {
			return parsedSource{}, fmt.Errorf("%w: a folder must be an absolute path (or file:///path, s3://bucket/prefix)", ErrInvalid)
		}
		return parsedSource{path: filepath.Clean(raw)}, nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return parsedSource{}, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	switch strings.ToLower(scheme) {
	case "file":
		if u.Opaque != "" || u.Host != "" && u.Host != "localhost" || u.User != nil || u.RawQuery != "" || u.Fragment != "" || !filepath.IsAbs(u.Path) {
			return parsedSource{}, fmt.Errorf("%w: a file URL takes an absolute path and nothing else, as in file:///abs/path", ErrInvalid)
		}
		return parsedSource{path: filepath.Clean(u.Path)}, nil
	case "s3":
		if u.User != nil || u.Opaque != "" || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			return parsedSource{}, fmt.Errorf("%w: want s3://bucket or s3://bucket/prefix (no credentials, query or fragment)", ErrInvalid)
		}
		prefix := strings.Trim(u.Path, "/")
		if prefix != "" {
			for seg := range strings.SplitSeq(prefix, "/") {
				if seg == "" || seg == "." || seg == ".." {
					return parsedSource{}, fmt.Errorf("%w: the key prefix %q has an empty, \".\" or \"..\" segment", ErrInvalid, prefix)
				}
			}
		}
		return parsedSource{s3: s3Prefix{bucket: u.Host, prefix: prefix}}, nil
	}
	return parsedSource{}, fmt.Errorf("%w: unsupported scheme %q: want a folder path, file:///path or s3://bucket/prefix", ErrInvalid, strings.ToLower(scheme))
}

// resolved is an allowed source: the key of its backend, and the real path
// of a local folder or the URL of an S3 prefix.
type resolved struct {
	key  string
	real string
	url  string
}

// redact drops the user information (a secret, maybe) of a URL, so that
// messages do not repeat it.
func redact(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		u.User = nil
		return u.String()
	}
	return raw
}

// resolve checks that a source may be read.
func (l *allowList) resolve(raw string) (resolved, error) {
	src, err := parseSource(raw)
	if err != nil {
		return resolved{}, fmt.Errorf("dataset source %q: %w", redact(raw), err)
	}
	if len(l.local)+len(l.s3) == 0 {
		return resolved{}, budget.Wrap(fmt.Errorf("%w: dataset source %q: the daemon allows no dataset sources; its operator names "+
			"the folders and s3://bucket/prefix sources trainers may read", ErrNotAllowed, raw), budget.DatasetSources)
	}
	if src.path == "" {
		for _, a := range l.s3 {
			if a.bucket == src.s3.bucket && beneath(src.s3.prefix, a.prefix) {
				u := "s3://" + src.s3.bucket + "/" + src.s3.prefix
				return resolved{key: u, url: u}, nil
			}
		}
		return resolved{}, l.refused("dataset source", raw, "")
	}
	real, err := filepath.EvalSymlinks(src.path)
	if err != nil {
		// Say "no such folder" only where the client may look: beneath an
		// allowed folder once the part that exists is resolved.
		if l.allowedReal(realOfMissing(src.path)) {
			return resolved{}, fmt.Errorf("%w: dataset source %q: no such folder", ErrInvalid, raw)
		}
		return resolved{}, l.refused("dataset source", raw, "")
	}
	if err := l.check("dataset source", raw, real); err != nil {
		return resolved{}, err
	}
	if fi, err := os.Stat(real); err != nil || !fi.IsDir() {
		return resolved{}, fmt.Errorf("%w: dataset source %q: no such folder", ErrInvalid, raw)
	}
	return resolved{key: "file://" + real, real: real}, nil
}

// check refuses a real path outside the allowed folders or overlapping an
// excluded one; what and name say what it is for messages.
func (l *allowList) check(what, name, real string) error {
	for _, x := range l.exclude {
		if beneath(real, x) || beneath(x, real) {
			return fmt.Errorf("%w: %s %q: %s is or holds the daemon's arena folder %s, which is never a dataset source",
				ErrNotAllowed, what, name, printable(real), x)
		}
	}
	if !l.allowedReal(real) {
		return l.refused(what, name, real)
	}
	return nil
}

func (l *allowList) allowedReal(real string) bool {
	for _, a := range l.local {
		if ra, err := filepath.EvalSymlinks(a); err == nil && beneath(real, ra) {
			return true
		}
	}
	return false
}

func (l *allowList) refused(what, name, real string) error {
	really := ""
	if real != "" && real != filepath.Clean(name) {
		really = fmt.Sprintf(" (really %s)", printable(real))
	}
	return budget.Wrap(fmt.Errorf("%w: %s %q%s is not beneath any source the daemon allows; ask its operator to add it",
		ErrNotAllowed, what, name, really), budget.DatasetSources)
}

// realOfMissing resolves the part of a missing path that exists.
func realOfMissing(p string) string {
	dir, rest := p, ""
	for {
		if real, err := filepath.EvalSymlinks(dir); err == nil {
			return filepath.Join(real, rest)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return p
		}
		rest = filepath.Join(filepath.Base(dir), rest)
		dir = parent
	}
}

// beneath reports whether p is prefix or lies below it, component by
// component: "a/b" is beneath "a", "ab" is not. Every path is beneath ""
// (a whole bucket) and every absolute path beneath "/".
func beneath(p, prefix string) bool {
	switch {
	case prefix == "" || prefix == "/" || p == prefix:
		return true
	case strings.HasSuffix(prefix, "/"):
		return strings.HasPrefix(p, prefix)
	}
	return strings.HasPrefix(p, prefix+"/")
}

// localBackend reads a local source: listings as package posix makes
// them (regular files only, links skipped), and shards resolved beneath
// the descriptor of the source's folder through no symbolic link, so a
// link swapped in after the listing -- at the shard or at a folder above
// it -- is refused, not followed (see open).
type localBackend struct {
	*posix.Backend
	allow *allowList
}

func openLocal(real string, allow *allowList) (storage.Backend, error) {
	b, err := posix.NewWithOptions(real, posix.Options{})
	if err != nil {
		return nil, err
	}
	return &localBackend{Backend: b, allow: allow}, nil
}

var errReadOnly = errors.New("dataset sources are read-only")

func (b *localBackend) Put(context.Context, string, io.Reader, int64) error { return errReadOnly }
func (b *localBackend) PutIfAbsent(context.Context, string, []byte) error   { return errReadOnly }
func (b *localBackend) Delete(context.Context, string) error                { return errReadOnly }
func (b *localBackend) DeleteTemporary(context.Context, storage.Temporary) error {
	return errReadOnly
}

// Get implements storage.Backend.
func (b *localBackend) Get(ctx context.Context, name string, offset, length int64) (io.ReadCloser, error) {
	f, fi, err := b.open(ctx, name)
	if err != nil {
		return nil, err
	}
	n := max(fi.Size()-offset, 0)
	if length >= 0 && length < n {
		n = length
	}
	return &sectionFile{io.NewSectionReader(f, offset, n), f}, nil
}

// mapShard maps a shard of size bytes read-only (see mapping); a file of
// another size than listed is ErrCorruptShard.
func (b *localBackend) mapShard(ctx context.Context, name string, size int64) (*mapping, error) {
	f, fi, err := b.open(ctx, name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() != size {
		return nil, fmt.Errorf("%w: %s is %d bytes, listed as %d (changed since the listing)", ErrCorruptShard, printable(name), fi.Size(), size)
	}
	return mapFile(f, size)
}

// open opens a shard for reading: a regular file beneath the source's
// root, reached through no symbolic link (see posix.OpenBeneath), whose
// real path lies in the source's folder and is allowed. A link or a file
// of another type swapped in since the listing is refused before anything
// is read, without blocking on a FIFO, and nothing outside the folder is
// opened: the open itself resolves beneath the root's descriptor.
// checkOpened then checks where the file really is, in case the folder
// itself was moved.
func (b *localBackend) open(ctx context.Context, name string) (*os.File, os.FileInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	f, err := b.OpenBeneath(name)
	var le *posix.LinkError
	switch {
	case errors.As(err, &le):
		// Not wrapped: storage.ErrSymlink would make it STORE_UNSAFE, and
		// this is a path the daemon may not read (PERMISSION_DENIED).
		return nil, nil, fmt.Errorf("%w: dataset shard %q: %s in the dataset's folder %s is a symbolic link (put there since the listing?), "+
			"and links in a dataset's folder are never followed", ErrNotAllowed, name, printable(le.Link), b.Root())
	case errors.Is(err, posix.ErrNotRegular):
		return nil, nil, fmt.Errorf("%w: dataset shard %q: %v; only regular files are read", ErrNotAllowed, name, err)
	case errors.Is(err, fs.ErrNotExist):
		return nil, nil, fmt.Errorf("shard %q: %w", name, storage.ErrNotFound)
	case err != nil:
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err == nil {
		err = b.checkOpened(f, name)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, fi, nil
}

// checkOpened checks the real path of an open file: beneath the source's
// folder (its real path when the session opened it), allowed, and not in
// the arena.
func (b *localBackend) checkOpened(f *os.File, name string) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var real string
	var rerr error
	if err := rc.Control(func(fd uintptr) { real, rerr = os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd)) }); err != nil {
		return err
	}
	if rerr != nil {
		return fmt.Errorf("%w: shard %q: cannot tell where it really is: %v", ErrNotAllowed, name, rerr)
	}
	real = strings.TrimSuffix(real, " (deleted)")
	shown := filepath.Join(b.Root(), name)
	if !beneath(real, b.Root()) {
		return fmt.Errorf("%w: dataset shard %q is really %s, outside the dataset's folder %s",
			ErrNotAllowed, shown, printable(real), b.Root())
	}
	return b.allow.check("dataset shard", shown, real)
}

type sectionFile struct {
	*io.SectionReader
	f *os.File
}

func (s *sectionFile) Close() error { return s.f.Close() }
