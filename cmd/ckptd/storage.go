package main

import (
	"context"
	"io/fs"
	"log/slog"
	"os"

	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/storageurl"
)

// openStorage opens a storage URL with the S3 and file mode settings of o; only serve's
// checkpoint store may be created (create), everything else must already
// exist.
func openStorage(ctx context.Context, url string, o *storageOptions, create bool) (storage.Backend, error) {
	log := slog.Default()
	if o.interactive && !log.Enabled(ctx, slog.LevelDebug) {
		// The command fails with one line if the retries do not help;
		// each retry is noise to the person waiting (--log-level debug
		// shows them).
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	}
	return storageurl.Open(ctx, url, storageurl.OpenOptions{
		S3Endpoint: o.S3Endpoint, S3Region: o.S3Region, S3RetryDeadline: o.S3Retry, S3StallTimeout: o.S3Stall, MustExist: !create,
		FileMode: fs.FileMode(o.FileMode), Logger: log,
	})
}
