package s3

import (
	"context"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/minio/minio-go/v7"

	"github.com/ckptd/ckptd/storage"
)

// uploadsPage is how many multipart uploads one listing request asks for
// (S3's most).
const uploadsPage = 1000

// ListTemporaries implements storage.Backend: the multipart uploads of
// keys under the backend's prefix plus prefix that were neither completed
// nor aborted, a Put's own while it runs and those of writers that died.
// Each Temporary's ID is the upload id, Size the bytes of its parts, and
// ModTime when its newest part was uploaded (its initiation, before any).
//
// It asks for every upload of the bucket and keeps those under the
// prefix: MinIO answers a listing of uploads only for an exact key or the
// whole bucket, never for a shorter prefix, and a bucket holds few uploads
// at a time (only those in flight, or left by crashes). Each upload kept
// costs one more request, for its parts.
func (b *Backend) ListTemporaries(ctx context.Context, prefix string, fn func(storage.Temporary) error) error {
	if err := storage.ValidPrefix(prefix); err != nil {
		return fmt.Errorf("s3: list temporaries: %w", err)
	}
	if !utf8.ValidString(prefix) {
		return fmt.Errorf("s3: list temporaries: %w %q: not valid UTF-8", storage.ErrInvalidName, prefix)
	}
	keyPrefix := b.root + prefix
	keyMarker, idMarker := "", ""
	for {
		var page minio.ListMultipartUploadsResult
		err := b.do(ctx, "list temporaries", keyPrefix, func(ctx context.Context, _ *watchdog) (err error) {
			page, err = b.core.ListMultipartUploads(ctx, b.bucket, "", keyMarker, idMarker, "", uploadsPage)
			return err
		})
		if err != nil {
			return err
		}
		for _, u := range page.Uploads {
			name, ok := strings.CutPrefix(u.Key, b.root)
			if !strings.HasPrefix(u.Key, keyPrefix) || !ok || validName(name) != nil {
				continue
			}
			t, found, err := b.temporary(ctx, name, u)
			if err != nil {
				return err
			}
			if !found {
				continue // completed or aborted since the listing
			}
			if err := fn(t); err != nil {
				return err
			}
		}
		if !page.IsTruncated || page.NextKeyMarker == "" && page.NextUploadIDMarker == "" {
			return nil
		}
		keyMarker, idMarker = page.NextKeyMarker, page.NextUploadIDMarker
	}
}

// temporary describes upload u of the object name from its parts; found
// is false when the upload is gone.
func (b *Backend) temporary(ctx context.Context, name string, u minio.ObjectMultipartInfo) (storage.Temporary, bool, error) {
	t := storage.Temporary{Name: name, ID: u.UploadID, ModTime: u.Initiated}
	marker := 0
	for {
		var parts minio.ListObjectPartsResult
		err := b.do(ctx, "list temporaries", u.Key, func(ctx context.Context, _ *watchdog) (err error) {
			parts, err = b.core.ListObjectParts(ctx, b.bucket, u.Key, u.UploadID, marker, uploadsPage)
			return err
		})
		if errorCode(err) == minio.NoSuchUpload {
			return t, false, nil
		}
		if err != nil {
			return t, false, err
		}
		for _, p := range parts.ObjectParts {
			t.Size += p.Size
			if p.LastModified.After(t.ModTime) {
				t.ModTime = p.LastModified
			}
		}
		if !parts.IsTruncated || parts.NextPartNumberMarker <= marker {
			return t, true, nil
		}
		marker = parts.NextPartNumberMarker
	}
}

// DeleteTemporary implements storage.Backend by aborting the multipart
// upload t.ID of t.Name: its parts are freed, and a Put still sending
// parts to it fails. An upload that is gone (completed, aborted) is no
// error; the object itself is never touched.
func (b *Backend) DeleteTemporary(ctx context.Context, t storage.Temporary) error {
	key, err := b.key(t.Name)
	if err != nil {
		return fmt.Errorf("s3: delete temporary: %w", err)
	}
	if t.ID == "" || !utf8.ValidString(t.ID) || strings.ContainsAny(t.ID, "/&?#") {
		return fmt.Errorf("s3: delete temporary of %q: %w: %q is not a multipart upload id", t.Name, storage.ErrInvalidName, t.ID)
	}
	return b.do(ctx, "delete temporary", key, func(ctx context.Context, _ *watchdog) error {
		err := b.core.AbortMultipartUpload(ctx, b.bucket, key, t.ID)
		if errorCode(err) == minio.NoSuchUpload {
			return nil
		}
		return err
	})
}
