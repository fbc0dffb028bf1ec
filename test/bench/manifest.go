package main

import (
	"context"

	"github.com/ckptd/ckptd/checkpoint"
)

func manifestOf(d *daemon, step int64) (*checkpoint.Store, *checkpoint.Manifest, error) {
	ctx := context.Background()
	store, err := checkpoint.NewStore(d.store, "bench")
	if err != nil {
		return nil, nil, err
	}
	rec, err := store.Resolve(ctx, step, false)
	if err != nil {
		return nil, nil, err
	}
	m, err := store.Manifest(ctx, rec, 0)
	return store, m, err
}
