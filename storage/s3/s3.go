package s3

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/minio/minio-go/v7/pkg/s3utils"

	"github.com/ckptd/ckptd/storage"
)

// Defaults for Config's zero values.
const (
	DefaultPartSize        = 16 << 20
	DefaultPartConcurrency = 8
	DefaultStallTimeout    = time.Minute
	// MinPartSize is S3's smallest part (but the last).
	MinPartSize = 5 << 20
	// maxKeyLen is S3's limit on a key, in bytes.
	maxKeyLen = 1024
)

// Config says which bucket to use and how.
type Config struct {
	// Bucket is the bucket name.
	Bucket string
	// Prefix is prepended, with a slash, to every object name: "" or a
	// valid object name such as "team/ckpt".
	Prefix string
	// Endpoint is the S3 endpoint URL, "http://host:port" or
	// "https://host"; empty means AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
	// or AWS itself.
	Endpoint string
	// Region is the bucket's region; empty means AWS_REGION,
	// AWS_DEFAULT_REGION, or asking the bucket.
	Region string
	// Credentials replace the default chain (see the package comment).
	Credentials *credentials.Credentials
	// PartSize is the size of a multipart upload's parts (default 16 MiB,
	// at least MinPartSize).
	PartSize int64
	// PartConcurrency is how many parts of one Put are in memory (being
	// filled or uploaded) at once (default 8).
	PartConcurrency int
	// Retry bounds the retries of each request.
	Retry RetryPolicy
	// StallTimeout cancels and retries a request that moves no bytes for
	// this long (default 1 minute).
	StallTimeout time.Duration
	// Logger receives a warning for each retry (default slog.Default()).
	Logger *slog.Logger
	// Transport replaces the HTTP transport (tests, custom TLS).
	Transport http.RoundTripper
}

// Errors for permanent failures that are not storage errors; they wrap
// the store's own error.
var (
	// ErrAccessDenied: the credentials are missing, wrong, or not allowed
	// to do this.
	ErrAccessDenied = errors.New("access denied")
	// ErrNoSuchBucket: the bucket does not exist at this endpoint.
	ErrNoSuchBucket = errors.New("no such bucket")
)

// Backend stores objects in an S3 bucket. It is safe for concurrent use,
// also by several processes and nodes sharing the bucket.
type Backend struct {
	client    *minio.Client
	core      minio.Core
	transport *http.Transport // ours to close; nil when the caller gave one
	bucket    string
	root      string // "" or the prefix with a trailing slash
	endpoint  string // scheme://host, for messages
	location  string
	anonymous bool // no credentials were found

	partSize int64
	partConc int
	retry    RetryPolicy
	stall    time.Duration
	log      *slog.Logger
	bufs     bufPool
}

var _ storage.Backend = (*Backend)(nil)

// New connects to the bucket and checks that it exists and that the
// credentials may use it, retrying transient failures. The caller closes
// the backend.
func New(ctx context.Context, cfg Config) (*Backend, error) {
	b, err := newBackend(cfg)
	if err != nil {
		return nil, err
	}
	if err := b.checkBucket(ctx); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

func newBackend(cfg Config) (*Backend, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	ep, err := endpointURL(cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	b := &Backend{
		bucket: cfg.Bucket, endpoint: ep.Scheme + "://" + ep.Host,
		partSize: cfg.PartSize, partConc: cfg.PartConcurrency,
		retry: cfg.Retry, stall: cfg.StallTimeout, log: cfg.Logger,
	}
	if cfg.Prefix != "" {
		b.root = cfg.Prefix + "/"
	}
	b.location = "s3://" + path(cfg.Bucket, cfg.Prefix)
	tr := cfg.Transport
	if tr == nil {
		if b.transport, err = newTransport(ep.Scheme == "https", cfg.StallTimeout); err != nil {
			return nil, err
		}
		tr = b.transport
	}
	creds := cfg.Credentials
	if creds == nil {
		creds = DefaultCredentials()
	}
	if v, err := creds.GetWithContext(nil); err == nil && v.AccessKeyID == "" {
		b.anonymous = true
	}
	b.client, err = minio.New(ep.Host, &minio.Options{
		Creds: creds, Secure: ep.Scheme == "https", Transport: tr,
		Region: regionOr(cfg.Region),
		// Retries are ours, per request, with a deadline (retry.go).
		MaxRetries: 1,
	})
	if err != nil {
		return nil, fmt.Errorf("s3: endpoint %s: %w", b.endpoint, err)
	}
	b.core = minio.Core{Client: b.client}
	return b, nil
}

func (c *Config) setDefaults() error {
	if err := s3utils.CheckValidBucketNameStrict(c.Bucket); err != nil {
		return fmt.Errorf("s3: bucket name %q: %w", c.Bucket, err)
	}
	if c.Prefix != "" {
		if err := validName(c.Prefix); err != nil {
			return fmt.Errorf("s3: prefix: %w", err)
		}
	}
	if c.PartSize == 0 {
		c.PartSize = DefaultPartSize
	}
	if c.PartSize < MinPartSize || c.PartSize > maxPartSize {
		return fmt.Errorf("s3: part size %d outside [%d, %d]", c.PartSize, MinPartSize, maxPartSize)
	}
	if c.PartConcurrency <= 0 {
		c.PartConcurrency = DefaultPartConcurrency
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = DefaultStallTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.Retry.setDefaults()
	return nil
}

// DefaultCredentials is the chain of credential sources New uses when
// Config.Credentials is nil; see the package comment.
func DefaultCredentials() *credentials.Credentials {
	return credentials.NewChainCredentials([]credentials.Provider{
		&credentials.EnvAWS{},
		&credentials.EnvMinio{},
		&credentials.FileAWSCredentials{},
		&credentials.IAM{},
	})
}

// endpointURL resolves and checks the endpoint. Error messages never
// repeat a URL that carries user information, which could be a secret.
func endpointURL(raw string) (*url.URL, error) {
	for _, env := range []string{"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"} {
		if raw == "" {
			raw = os.Getenv(env)
		}
	}
	if raw == "" {
		raw = "https://s3.amazonaws.com"
	}
	u, err := url.Parse(raw)
	switch {
	case err != nil:
		return nil, errors.New("s3: the endpoint must be an http:// or https:// URL, such as http://127.0.0.1:9000 or https://s3.amazonaws.com")
	case u.User != nil:
		return nil, errors.New("s3: the endpoint URL must be without credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("s3: endpoint %q: want an http:// or https:// URL (the scheme decides TLS)", raw)
	case u.Host == "":
		return nil, fmt.Errorf("s3: endpoint %q has no host", raw)
	case strings.Trim(u.Path, "/") != "" || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("s3: endpoint %q: want only a scheme and host, as in https://s3.amazonaws.com", raw)
	}
	return u, nil
}

func regionOr(region string) string {
	for _, env := range []string{"AWS_REGION", "AWS_DEFAULT_REGION"} {
		if region == "" {
			region = os.Getenv(env)
		}
	}
	return region
}

// newTransport is minio-go's default transport with room for many
// parallel requests to one host, and the stall timeout for headers.
func newTransport(secure bool, stall time.Duration) (*http.Transport, error) {
	tr, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, err
	}
	tr.MaxIdleConnsPerHost = 256
	tr.ResponseHeaderTimeout = stall
	return tr, nil
}

// checkBucket fails fast on a missing bucket or unusable credentials.
func (b *Backend) checkBucket(ctx context.Context) error {
	var exists bool
	err := b.do(ctx, "open", "", func(ctx context.Context, _ *watchdog) (err error) {
		exists, err = b.client.BucketExists(ctx, b.bucket)
		return err
	})
	if err != nil {
		return err
	}
	if !exists {
		return b.opError("open", "", minio.ErrorResponse{Code: minio.NoSuchBucket, StatusCode: http.StatusNotFound})
	}
	return nil
}

// Location returns "s3://bucket/prefix".
func (b *Backend) Location() string { return b.location }

// Bucket returns the bucket name.
func (b *Backend) Bucket() string { return b.bucket }

// Prefix returns the key prefix ("" or ending in "/").
func (b *Backend) Prefix() string { return b.root }

// Endpoint returns the endpoint as scheme://host.
func (b *Backend) Endpoint() string { return b.endpoint }

// Close releases idle connections.
func (b *Backend) Close() error {
	if b.transport != nil {
		b.transport.CloseIdleConnections()
	}
	return nil
}

// key maps an object name to its key, rejecting names S3 cannot hold.
func (b *Backend) key(name string) (string, error) {
	if err := validName(name); err != nil {
		return "", err
	}
	key := b.root + name
	if len(key) > maxKeyLen {
		return "", fmt.Errorf("%w %q: key longer than %d bytes", storage.ErrInvalidName, name, maxKeyLen)
	}
	return key, nil
}

// validName is storage.ValidName plus S3's rule that keys are UTF-8.
func validName(name string) error {
	if err := storage.ValidName(name); err != nil {
		return err
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("%w %q: not valid UTF-8", storage.ErrInvalidName, name)
	}
	return nil
}

// Stat implements storage.Backend.
func (b *Backend) Stat(ctx context.Context, name string) (storage.ObjectInfo, error) {
	key, err := b.key(name)
	if err != nil {
		return storage.ObjectInfo{}, fmt.Errorf("s3: stat: %w", err)
	}
	info, err := b.stat(ctx, "stat", key)
	if err != nil {
		return storage.ObjectInfo{}, err
	}
	return storage.ObjectInfo{Name: name, Size: info.Size, ModTime: info.LastModified}, nil
}

func (b *Backend) stat(ctx context.Context, op, key string) (info minio.ObjectInfo, err error) {
	err = b.do(ctx, op, key, func(ctx context.Context, _ *watchdog) (err error) {
		info, err = b.client.StatObject(ctx, b.bucket, key, minio.StatObjectOptions{})
		return err
	})
	return info, err
}

// Delete implements storage.Backend. S3 deletes missing keys without
// complaint, so Delete looks first to report ErrNotFound.
func (b *Backend) Delete(ctx context.Context, name string) error {
	key, err := b.key(name)
	if err != nil {
		return fmt.Errorf("s3: delete: %w", err)
	}
	return b.do(ctx, "delete", key, func(ctx context.Context, _ *watchdog) error {
		return b.client.RemoveObject(ctx, b.bucket, key, minio.RemoveObjectOptions{})
	})
}

// path joins a bucket and a key for messages.
func path(bucket, key string) string {
	if key == "" {
		return bucket
	}
	return bucket + "/" + key
}
