// Package s3 implements storage.Backend on an S3-compatible object store
// (AWS S3, MinIO, Ceph RGW, ...) with minio-go.
//
// # Layout
//
// The object "a/b/c" of a backend opened on s3://bucket/prefix is the key
// "prefix/a/b/c" of the bucket (just "a/b/c" without a prefix). Keys are
// flat, so unlike the POSIX backend "a" and "a/b" can coexist. Keys that are
// not valid object names (a console's "dir/" markers, "a//b") are skipped by
// List and cannot be addressed.
//
// # Endpoint, region and credentials
//
// The endpoint is Config.Endpoint, else AWS_ENDPOINT_URL_S3, else
// AWS_ENDPOINT_URL, else AWS; its scheme decides TLS ("http://127.0.0.1:9000"
// or "https://..."). The region is Config.Region, else AWS_REGION, else
// AWS_DEFAULT_REGION, else asked of the bucket. Credentials come from the
// first source that has some: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
// (/ AWS_SESSION_TOKEN), MINIO_ROOT_USER / MINIO_ROOT_PASSWORD (or
// MINIO_ACCESS_KEY / MINIO_SECRET_KEY), ~/.aws/credentials (AWS_PROFILE,
// AWS_SHARED_CREDENTIALS_FILE), then the EC2/ECS/EKS instance role. They
// are never logged or put in error messages.
//
// # Atomicity and durability
//
// An S3 object becomes visible whole when its PUT, or the completion of its
// multipart upload, succeeds, and replaces the old one atomically; a
// success means the store has made it durable. So Put streams the object as
// a multipart upload and completes it last. A failed or cancelled Put aborts
// its upload, so no parts are left behind to be billed; only a crash (or an
// abort that fails for as long as the retry deadline) can leave one. Such
// uploads are the store's temporaries: ListTemporaries lists them (by the
// time of their newest part) and DeleteTemporary aborts one, which is how
// `ckptd prune` removes those idle past --gc-grace; a bucket lifecycle
// rule (AbortIncompleteMultipartUpload) cleans up after writers under
// other prefixes too.
//
// PutIfAbsent is a single PUT with "If-None-Match: *", which the store
// evaluates atomically: of racing writers exactly one succeeds and the
// others get 412 Precondition Failed (storage.ErrExists). AWS S3 supports
// this since August 2024, MinIO for longer.
//
// Delete is one DELETE: deleting a missing key succeeds, which is the
// storage.Backend contract too.
//
// # Integrity
//
// Every PUT and part carries a CRC32C of its bytes in a signed header; the
// store refuses a body that does not match, and the backend resends it.
// The payload itself is not signed (UNSIGNED-PAYLOAD): SHA-256 signing of
// every byte, minio-go's default over plain HTTP, costs far more CPU than a
// drain can spare. Chunks are verified end to end against their xxh3 hashes
// on restore in any case.
//
// # Memory
//
// Put reads a part at a time into buffers from a pool the backend's Puts
// share, and uploads up to Config.PartConcurrency parts at once. A Put holds
// at most PartConcurrency part buffers (the one being filled and those being
// uploaded), so its memory is bounded by PartConcurrency × part size: 8 ×
// 16 MiB = 128 MiB with the defaults, for objects of up to 2,500 parts
// (39 GiB). To fit S3's 10,000 parts, the part size doubles every 2,500
// parts (up to 8× at ~290 GiB, reaching ~585 GiB in all), and a Put of known
// size beyond 10,000 × PartSize uses parts of size/10,000; the bound grows
// with the part size. Objects smaller than a part are sent with one PUT
// from a buffer of their own size.
//
// # Retries
//
// Every request is retried on its own, with exponential backoff and full
// jitter, for as long as Config.Retry.Deadline allows: 5xx responses,
// 503 SlowDown and other throttling, request timeouts, connection refusals
// and resets, and requests that make no progress for Config.StallTimeout (a
// frozen server or a black-holed connection; the stall clock runs only
// while the backend waits on the network). Retrying requests rather than
// whole operations is what lets a streaming Put survive an outage without
// holding the whole object to start again: only the part in flight is
// resent. A Get whose body fails midway reopens the rest of its range,
// pinned to the object's ETag so it never splices two versions. Permanent
// errors (access denied, bad credentials, a missing bucket) fail at once,
// with a message that names the bucket and endpoint; ErrAccessDenied and
// ErrNoSuchBucket match them.
package s3
