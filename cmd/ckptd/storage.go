package main

import (
	"context"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/storageurl"
)

func openStorage(ctx context.Context, url, s3Endpoint, s3Region string) (storage.Backend, error) {
	return storageurl.Open(ctx, url, storageurl.OpenOptions{S3Endpoint: s3Endpoint, S3Region: s3Region})
}
