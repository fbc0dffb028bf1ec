package main

import (
	"context"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/storageurl"
)

// openStorage opens a storage URL; only serve's checkpoint store may be
// created (create), everything else must already exist.
func openStorage(ctx context.Context, url, s3Endpoint, s3Region string, create bool) (storage.Backend, error) {
	return storageurl.Open(ctx, url, storageurl.OpenOptions{S3Endpoint: s3Endpoint, S3Region: s3Region, MustExist: !create})
}
