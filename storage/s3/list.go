package s3

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/minio/minio-go/v7"

	"github.com/ckptd/ckptd/storage"
)

// List implements storage.Backend with ListObjectsV2, whose order (UTF-8
// binary) is the lexical order of names. A listing that fails midway
// resumes after the last key it saw. Keys that are not valid object names
// are skipped.
//
// MinIO refuses prefixes with a "." or ".." segment, which the last,
// partial segment of a valid prefix may be ("a/." can start "a/.x"); such
// a listing asks for the parent "directory" and filters.
func (b *Backend) List(ctx context.Context, prefix string, fn func(storage.ObjectInfo) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("s3: list: %w", err)
	}
	if !utf8.ValidString(prefix) {
		return fmt.Errorf("s3: list: %w %q: not valid UTF-8", storage.ErrInvalidName, prefix)
	}
	keyPrefix := b.root + prefix
	return b.resumeList(ctx, keyPrefix, func(after *string) error {
		return b.listFrom(ctx, keyPrefix, serverPrefix(keyPrefix), after, fn)
	})
}

// resumeList runs page, a listing from *after on, until it finishes, and
// again from where it stopped after each transient failure. The retry
// deadline runs from the last progress, not from the start: a long
// listing is not one request.
func (b *Backend) resumeList(ctx context.Context, keyPrefix string, page func(after *string) error) error {
	bo := b.newBackoff()
	after := ""
	for {
		if err := ctx.Err(); err != nil {
			return b.opError("list", keyPrefix, err)
		}
		from := after
		err := page(&after)
		if after != from {
			bo = b.newBackoff()
		}
		var fe fnError
		switch {
		case err == nil:
			return nil
		case errors.As(err, &fe):
			return fe.err // the caller's own error, as it gave it
		case !b.retryable(ctx, bo, "list", keyPrefix, err):
			return b.opError("list", keyPrefix, err)
		}
	}
}

func serverPrefix(keyPrefix string) string {
	dir, last := "", keyPrefix
	if i := strings.LastIndexByte(keyPrefix, '/'); i >= 0 {
		dir, last = keyPrefix[:i+1], keyPrefix[i+1:]
	}
	if last == "." || last == ".." {
		return dir
	}
	return keyPrefix
}

// fnError carries an error from List's callback out of the listing.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }

// listFrom lists the keys after *after, advancing it. The watchdog runs
// only while the listing waits for the store, not while fn works.
func (b *Backend) listFrom(ctx context.Context, keyPrefix, ask string, after *string, fn func(storage.ObjectInfo) error) error {
	actx, wd := b.startAttempt(ctx, true)
	defer wd.stop()
	noOwner := false
	opts := minio.ListObjectsOptions{Prefix: ask, Recursive: true, StartAfter: *after, FetchOwner: &noOwner}
	for obj := range b.client.ListObjectsIter(actx, b.bucket, opts) {
		if obj.Err != nil {
			return wd.result(obj.Err)
		}
		*after = obj.Key
		if !strings.HasPrefix(obj.Key, keyPrefix) {
			if obj.Key > keyPrefix {
				return nil // sorted: nothing further can match
			}
			continue
		}
		name, ok := strings.CutPrefix(obj.Key, b.root)
		if !ok || validName(name) != nil {
			continue
		}
		wd.pause()
		err := fn(storage.ObjectInfo{Name: name, Size: obj.Size, ModTime: obj.LastModified})
		wd.resume()
		if err != nil {
			return fnError{err}
		}
	}
	// The listing stops silently when its context ends.
	return wd.result(actx.Err())
}

// ListDirs implements storage.Backend with ListObjectsV2 and delimiter
// "/": one request per 1000 directories, whatever lies below them. A
// listing that fails midway starts again after the last directory it
// gave; the store may then report that directory once more (its keys sort
// after it), and such repeats are dropped.
func (b *Backend) ListDirs(ctx context.Context, dir string, fn func(seg string) error) error {
	if err := storage.ValidDir(dir); err != nil {
		return fmt.Errorf("s3: list dirs: %w", err)
	}
	if !utf8.ValidString(dir) {
		return fmt.Errorf("s3: list dirs: %w %q: not valid UTF-8", storage.ErrInvalidName, dir)
	}
	keyPrefix := b.root + dir
	return b.resumeList(ctx, keyPrefix, func(after *string) error {
		return b.listDirsFrom(ctx, keyPrefix, after, fn)
	})
}

// listDirsFrom lists the common prefixes after *after, advancing it.
func (b *Backend) listDirsFrom(ctx context.Context, keyPrefix string, after *string, fn func(string) error) error {
	actx, wd := b.startAttempt(ctx, true)
	defer wd.stop()
	noOwner := false
	opts := minio.ListObjectsOptions{Prefix: keyPrefix, Recursive: false, StartAfter: *after, FetchOwner: &noOwner}
	for obj := range b.client.ListObjectsIter(actx, b.bucket, opts) {
		if obj.Err != nil {
			return wd.result(obj.Err)
		}
		rest, ok := strings.CutPrefix(obj.Key, keyPrefix)
		seg, isDir := strings.CutSuffix(rest, "/")
		if !ok || !isDir || strings.Contains(seg, "/") || obj.Key <= *after {
			continue // an object directly in dir, or a repeat after a resume
		}
		*after = obj.Key
		if validName(seg) != nil {
			continue
		}
		wd.pause()
		err := fn(seg)
		wd.resume()
		if err != nil {
			return fnError{err}
		}
	}
	return wd.result(actx.Err())
}
