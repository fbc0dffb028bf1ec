package main

import (
	"context"
	"io/fs"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/storageurl"
)

// openStorage opens a storage URL with the S3 and file mode settings of o; only serve's
// checkpoint store may be created (create), everything else must already
// exist.
func openStorage(ctx context.Context, url string, o *storageOptions, create bool) (storage.Backend, error) {
	return storageurl.Open(ctx, url, storageurl.OpenOptions{
		S3Endpoint: o.S3Endpoint, S3Region: o.S3Region, S3RetryDeadline: o.S3Retry, MustExist: !create,
		FileMode: fs.FileMode(o.FileMode),
	})
}
