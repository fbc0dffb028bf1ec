package s3

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/minio/minio-go/v7"

	"github.com/ckptd/ckptd/storage"
)

// opError maps err to the storage errors and wraps it with the operation,
// the object (or bucket) and the endpoint, so a message always says where.
func (b *Backend) opError(op, key string, err error) error {
	where := fmt.Sprintf("s3://%s at %s", path(b.bucket, key), b.endpoint)
	if !transportTimeout(err) && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return fmt.Errorf("s3: %s %s: %w", op, where, err)
	}
	if isTransient(err) { // still failing when the retries ran out
		return fmt.Errorf("s3: %s %s: %w: %w", op, where, storage.ErrUnavailable, err)
	}
	var er minio.ErrorResponse
	if !errors.As(err, &er) {
		return fmt.Errorf("s3: %s %s: %w", op, where, err)
	}
	switch {
	case er.Code == minio.NoSuchBucket:
		return fmt.Errorf("s3: %s: bucket %q does not exist at %s: %w", op, b.bucket, b.endpoint, ErrNoSuchBucket)
	case isNotFound(er):
		return fmt.Errorf("s3: %s %s: %w", op, where, storage.ErrNotFound)
	case isDenied(er):
		return fmt.Errorf("s3: %s %s: %w to bucket %q at %s (%s: %s); %s",
			op, where, ErrAccessDenied, b.bucket, b.endpoint, er.Code, er.Message, b.credentialHint())
	case isFull(er):
		return fmt.Errorf("s3: %s %s: %w (%s: %s)", op, where, storage.ErrNoSpace, er.Code, er.Message)
	}
	return fmt.Errorf("s3: %s %s: %w", op, where, err)
}

func (b *Backend) credentialHint() string {
	if b.anonymous {
		return "no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or MINIO_ROOT_USER and MINIO_ROOT_PASSWORD), use ~/.aws/credentials, or an instance role"
	}
	return "check the credentials (AWS_ACCESS_KEY_ID, MINIO_ROOT_USER, ~/.aws/credentials or the instance role) and the bucket policy"
}

func isNotFound(er minio.ErrorResponse) bool {
	switch er.Code {
	case minio.NoSuchKey, "NotFound":
		return true
	case minio.NoSuchBucket, minio.NoSuchUpload:
		return false
	}
	return er.StatusCode == http.StatusNotFound
}

func isDenied(er minio.ErrorResponse) bool {
	switch er.Code {
	case minio.AccessDenied, "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
		"AccountProblem", "AllAccessDisabled", "ExpiredToken", "InvalidSecurity":
		return true
	}
	return er.StatusCode == http.StatusForbidden || er.StatusCode == http.StatusUnauthorized
}

func isFull(er minio.ErrorResponse) bool {
	switch er.Code {
	case "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "QuotaExceeded":
		return true
	}
	return er.StatusCode == http.StatusInsufficientStorage
}

// errorCode returns the S3 error code of err, if it has one.
func errorCode(err error) string {
	var er minio.ErrorResponse
	if errors.As(err, &er) {
		return er.Code
	}
	return ""
}
