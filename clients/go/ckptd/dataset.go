//go:build linux

package ckptd

import (
	"context"
	"time"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// DatasetRequest describes one rank's pass over one epoch of a dataset.
type DatasetRequest struct {
	Source        string // folder, file:///path or s3://bucket/prefix
	Format        string // "webdataset" (default) or "raw"
	BatchSize     int
	Rank          int
	WorldSize     int
	Seed          uint64
	Epoch         int64
	Start         int64 // samples this rank already consumed this epoch
	ShuffleWindow int
	// ShuffleBlock shuffles in blocks of this many shards instead of the
	// window (see OpenDatasetRequest.shuffle_block; 0: off).
	ShuffleBlock int
	SkipCorrupt  bool
	// Even shares the epoch's samples out evenly among the ranks: "pad"
	// (also ""), "drop" or "off" (see OpenDatasetRequest.even).
	Even string
}

// Sample is one delivered sample. Field data aliases the daemon's shared
// memory and is valid until the next call to Next or Close: copy what
// must outlive the batch.
type Sample struct {
	Key    string
	Fields map[string][]byte
}

// PrefetchStats are a session's totals.
type PrefetchStats struct {
	WaitStorage, WaitCache, WaitRing, WaitWork time.Duration
	CacheHits, CacheMisses, CorruptSkipped     int64
	Padded                                     int64 // samples repeated to pad the epoch (Even "pad")
}

// Dataset iterates a session's batches.
type Dataset struct {
	c        *Client
	session  string
	held     []string
	position int64
	stats    PrefetchStats
}

// Dataset opens a dataset session.
func (c *Client) Dataset(ctx context.Context, req *DatasetRequest) (*Dataset, error) {
	resp, err := c.pf.OpenDataset(ctx, &pb.OpenDatasetRequest{
		Source: req.Source, Format: req.Format, BatchSize: int32(req.BatchSize), Rank: int32(req.Rank),
		WorldSize: int32(req.WorldSize), Seed: req.Seed, Epoch: req.Epoch, Start: req.Start,
		ShuffleWindow: int32(req.ShuffleWindow), ShuffleBlock: int32(req.ShuffleBlock), SkipCorrupt: req.SkipCorrupt, Even: req.Even,
	})
	if err != nil {
		return nil, c.wrap(err)
	}
	return &Dataset{c: c, session: resp.GetSession(), position: req.Start}, nil
}

// Next returns the next batch, or nil at the end of the epoch. It gives
// the previous batch's slot back to the daemon.
func (d *Dataset) Next(ctx context.Context) ([]Sample, error) {
	resp, err := d.c.pf.NextBatch(ctx, &pb.NextBatchRequest{Session: d.session, Release: d.held})
	if err != nil {
		return nil, d.c.wrap(err)
	}
	d.held = nil
	d.stats = fromPBStats(resp.GetStats())
	if resp.GetEnd() {
		return nil, nil
	}
	d.held = []string{resp.GetLease().GetId()}
	d.position = resp.GetPosition()
	region, err := d.c.region(ctx, resp.GetLease())
	if err != nil {
		return nil, err
	}
	out := make([]Sample, len(resp.GetSamples()))
	for i, s := range resp.GetSamples() {
		out[i] = Sample{Key: s.GetKey(), Fields: make(map[string][]byte, len(s.GetFields()))}
		for _, f := range s.GetFields() {
			out[i].Fields[f.GetName()] = region[f.GetOffset() : f.GetOffset()+f.GetLength() : f.GetOffset()+f.GetLength()]
		}
	}
	return out, nil
}

// Position is the samples this rank has consumed this epoch: store it in
// checkpoint metadata and pass it as Start to resume.
func (d *Dataset) Position() int64 { return d.position }

// Stats returns the session's totals as of the last batch.
func (d *Dataset) Stats() PrefetchStats { return d.stats }

// Close ends the session.
func (d *Dataset) Close(ctx context.Context) error {
	_, err := d.c.pf.CloseDataset(ctx, &pb.CloseDatasetRequest{Session: d.session})
	if err != nil {
		return d.c.wrap(err)
	}
	return nil
}

func fromPBStats(s *pb.PrefetchStats) PrefetchStats {
	return PrefetchStats{
		WaitStorage: time.Duration(s.GetWaitStorageNs()), WaitCache: time.Duration(s.GetWaitCacheNs()),
		WaitRing: time.Duration(s.GetWaitRingNs()), WaitWork: time.Duration(s.GetWaitWorkNs()),
		CacheHits: s.GetCacheHits(), CacheMisses: s.GetCacheMisses(), CorruptSkipped: s.GetCorruptSkipped(),
		Padded: s.GetPadded(),
	}
}
