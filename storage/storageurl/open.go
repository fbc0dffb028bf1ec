// Package storageurl opens the storage.Backend a user names with a storage
// URL (ckptd's --storage flag). It is separate from package storage because
// it imports the implementations, which import storage.
//
// Accepted forms:
//
//	/abs/path, rel/path     a POSIX directory; relative paths are made absolute
//	file:///abs/path        the same, as a URL (file://localhost/abs/path too)
//	s3://bucket/prefix      an S3 bucket, under the key prefix "prefix/" (optional);
//	                        the endpoint, region and credentials as package s3 says
package storageurl

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
	"github.com/ckptd/ckptd/storage/s3"
)

// OpenOptions carry the settings that do not fit in a storage URL.
type OpenOptions struct {
	// S3Endpoint is the S3 endpoint URL (MinIO, a private cloud); empty
	// means AWS_ENDPOINT_URL, else AWS. Credentials come from the usual
	// environment variables, ~/.aws/credentials or the instance role.
	S3Endpoint string
	// S3Region is the S3 region; empty means AWS_REGION, else the
	// bucket's.
	S3Region string
	// S3RetryDeadline bounds how long one S3 request is retried through
	// transient errors (5xx, throttling, resets); 0 means the backend's
	// default of 2 minutes.
	S3RetryDeadline time.Duration
	// S3StallTimeout cancels and retries an S3 request that moves no
	// bytes for this long (a frozen endpoint); 0 means the backend's
	// default of a minute.
	S3StallTimeout time.Duration
	// DisableDirectIO makes POSIX stores write through the page cache only.
	DisableDirectIO bool
	// FileMode is the mode of the objects a POSIX store writes, whatever
	// the umask (folders get x where r is set); zero means
	// posix.DefaultFileMode (0640). S3 ignores it.
	FileMode fs.FileMode
	// MustExist refuses a POSIX folder that does not exist instead of
	// creating it: readers (list, restore, a dataset source) must not leave
	// an empty folder behind for a mistyped path.
	MustExist bool
	// Logger receives the S3 backend's retry warnings (default
	// slog.Default()).
	Logger *slog.Logger
}

// Open returns the backend for rawURL. The caller closes it.
func Open(ctx context.Context, rawURL string, opts OpenOptions) (storage.Backend, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if rawURL == "" {
		return nil, errors.New("empty storage URL: want a directory path, file:///abs/path or s3://bucket/prefix")
	}
	scheme, ok := urlScheme(rawURL)
	if !ok {
		return openDir(rawURL, opts)
	}
	switch scheme {
	case "file":
		return openFileURL(rawURL, opts)
	case "s3":
		return openS3(ctx, rawURL, opts)
	default:
		return nil, fmt.Errorf("storage URL %q: unsupported scheme %q: want a directory path, file:///abs/path or s3://bucket/prefix", rawURL, scheme)
	}
}

// urlScheme returns the lower-cased scheme of a "scheme://..." URL, and
// reports whether s is one; anything else is a plain path. "file:" and "s3:"
// without the slashes count as (malformed) URLs rather than odd relative
// paths, since that is what the user meant.
func urlScheme(s string) (string, bool) {
	i := strings.Index(s, ":")
	if i <= 0 || !validScheme(s[:i]) {
		return "", false
	}
	scheme := strings.ToLower(s[:i])
	if strings.HasPrefix(s[i:], "://") || scheme == "file" || scheme == "s3" {
		return scheme, true
	}
	return "", false
}

// validScheme applies RFC 3986: a letter, then letters, digits, "+", "-", ".".
func validScheme(s string) bool {
	for i, c := range s {
		letter := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
		other := c >= '0' && c <= '9' || c == '+' || c == '-' || c == '.'
		if !letter && (i == 0 || !other) {
			return false
		}
	}
	return true
}

func openFileURL(rawURL string, opts OpenOptions) (storage.Backend, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("storage URL %q: %w", rawURL, err)
	}
	switch {
	case u.Opaque != "" || (u.Host != "" && u.Host != "localhost"):
		return nil, fmt.Errorf("storage URL %q: a file URL needs an absolute path, as in file:///abs/path (three slashes); or give a plain path", rawURL)
	case u.User != nil || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("storage URL %q: a file URL takes only a path (escape '?' and '#' as %%3F and %%23)", rawURL)
	case !filepath.IsAbs(u.Path):
		return nil, fmt.Errorf("storage URL %q: a file URL needs an absolute path, as in file:///abs/path", rawURL)
	}
	return openDir(u.Path, opts)
}

func openDir(dir string, opts OpenOptions) (storage.Backend, error) {
	if opts.MustExist {
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("storage %q: no such folder", dir)
		}
	}
	b, err := posix.NewWithOptions(dir, posix.Options{DirectIO: !opts.DisableDirectIO, FileMode: opts.FileMode})
	if err != nil {
		return nil, fmt.Errorf("storage %q: %w", dir, err)
	}
	return b, nil
}

// openS3 opens s3://bucket/prefix. Messages about a URL with user
// information do not repeat it: that part could hold a secret.
func openS3(ctx context.Context, rawURL string, opts OpenOptions) (storage.Backend, error) {
	u, err := url.Parse(rawURL)
	switch {
	case err != nil:
		return nil, fmt.Errorf("storage URL %q: %w", rawURL, err)
	case u.User != nil:
		return nil, errors.New("storage URL: an s3 URL must not hold credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
	case u.Opaque != "" || u.Host == "":
		return nil, fmt.Errorf("storage URL %q: want s3://bucket or s3://bucket/prefix", rawURL)
	case u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("storage URL %q: an s3 URL takes only a bucket and a prefix (the endpoint goes in --s3-endpoint)", rawURL)
	}
	b, err := s3.New(ctx, s3.Config{
		Bucket: u.Host, Prefix: strings.Trim(u.Path, "/"),
		Endpoint: opts.S3Endpoint, Region: opts.S3Region,
		Retry: s3.RetryPolicy{Deadline: opts.S3RetryDeadline}, StallTimeout: opts.S3StallTimeout, Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("storage %q: %w", rawURL, err)
	}
	return b, nil
}
