package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// TryCommit commits the step when all world_size rank manifests are in
// storage, creating COMMIT.json only if absent. It decides from storage,
// not from memory, so sidecars on several nodes sharing a store need no
// coordinator (see the package comment). It reports whether the step is
// committed (by this call or another) and whether this call wrote the
// commit record.
func TryCommit(ctx context.Context, b storage.Backend, job string, step int64, worldSize int) (committed, won bool, err error) {
	if worldSize < 1 || worldSize > MaxWorldSize {
		return false, false, fmt.Errorf("%w: world size %d", ErrInvalid, worldSize)
	}
	if _, err := b.Stat(ctx, commitName(job, step)); err == nil {
		return true, false, nil
	} else if !errors.Is(err, storage.ErrNotFound) {
		return false, false, err
	}
	names, err := listManifests(ctx, b, job, step)
	if err != nil || len(names) < worldSize {
		return false, false, err
	}
	rec, err := summarize(ctx, b, job, step, worldSize, names)
	if err != nil {
		return false, false, err
	}
	data, err := json.MarshalIndent(rec, "", " ")
	if err != nil {
		return false, false, err
	}
	err = b.PutIfAbsent(ctx, commitName(job, step), data)
	if errors.Is(err, storage.ErrExists) {
		return true, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("commit step %d: %w", step, err)
	}
	return true, true, nil
}

func listManifests(ctx context.Context, b storage.Backend, job string, step int64) ([]string, error) {
	var names []string
	err := b.List(ctx, stepDir(job, step), func(oi storage.ObjectInfo) error {
		if strings.HasSuffix(oi.Name, manifestSuffix) {
			names = append(names, oi.Name)
		}
		return nil
	})
	return names, err
}

// summarize reads every rank's manifest, checks that they describe ranks
// 0..worldSize-1 of one step, and builds the commit record.
func summarize(ctx context.Context, b storage.Backend, job string, step int64, worldSize int, names []string) (*CommitRecord, error) {
	rec := &CommitRecord{
		Format: CommitFormat, Version: CommitVersion,
		Job: job, Step: step, WorldSize: worldSize, CommittedAt: time.Now().UTC(),
	}
	seen := make([]bool, worldSize)
	for _, name := range names {
		m, err := readManifest(ctx, b, name)
		if err != nil {
			return nil, err
		}
		if m.WorldSize != worldSize || m.Step != step || m.Job != job || seen[m.Rank] {
			return nil, fmt.Errorf("%w: %s describes %s, conflicting with a world size of %d for step %d",
				ErrCorrupt, name, m.Target(), worldSize, step)
		}
		seen[m.Rank] = true
		rec.Bytes += m.DataSize
		rec.StoredBytes += m.StoredSize
	}
	return rec, nil
}

func readManifest(ctx context.Context, b storage.Backend, name string) (*Manifest, error) {
	data, err := readObject(ctx, b, name, maxManifestBytes)
	if err != nil {
		return nil, err
	}
	m, err := ParseManifest(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return m, nil
}

func readObject(ctx context.Context, b storage.Backend, name string, limit int64) ([]byte, error) {
	rc, err := b.Get(ctx, name, 0, -1)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := readAll(rc, limit)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	return data, nil
}
