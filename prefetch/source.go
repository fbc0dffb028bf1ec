package prefetch

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Format is how a dataset's objects hold samples.
type Format string

// The supported formats. Auto (also "") tells the format from what the
// source holds: see listDataset.
const (
	WebDataset Format = "webdataset"
	Raw        Format = "raw"
	MDS        Format = "mds"     // Mosaic streaming's index.json and shard.*.mds files
	Parquet    Format = "parquet" // .parquet files, a row group a shard, a column a field
	Auto       Format = "auto"
)

// ErrInvalid: a dataset request is malformed.
var ErrInvalid = errors.New("invalid dataset request")

// ErrCorruptShard: a shard could not be parsed.
var ErrCorruptShard = errors.New("corrupt shard")

// ErrOverBudget: a configured bound of the dataset service is used up (the
// datasets' share of the arena, the open sources); the daemon answers
// RESOURCE_EXHAUSTED. The message names the flag that sets the bound.
var ErrOverBudget = errors.New("dataset budget used up")

// ParseFormat checks a format name.
func ParseFormat(s string) (Format, error) {
	switch f := Format(s); f {
	case WebDataset, Raw, MDS, Parquet, Auto:
		return f, nil
	case "":
		return Auto, nil
	}
	return "", fmt.Errorf("%w: unknown format %q (want auto, webdataset, mds, parquet or raw)", ErrInvalid, s)
}

// Shard is one object of a dataset.
type Shard struct {
	Name    string // full object name in the backend; object#n for row group n of a Parquet file
	Size    int64  // bytes read from the backend
	ModTime time.Time
	unit    *unit // what the format's metadata says of it (MDS, Parquet); nil for tar and raw
	// An iteration's: where it is read from, and (in a mixture) its id.
	src *shardSource
	id  string
}

// ID is what names the shard in positions (Delivered): its name, or in a
// mixture its source, that source's epoch and its name.
func (sh *Shard) ID() string {
	if sh.id != "" {
		return sh.id
	}
	return sh.Name
}

// ListShards lists a dataset's shards under prefix, in name order: .tar
// objects for WebDataset, every object for Raw. An empty dataset is an
// error, since iterating it would deliver nothing without saying why. So
// is one whose listing would cost an iteration more than budget bytes
// (listCost per shard: the list, and the cache's plan of the epochs
// ahead), so that a prefix holding millions of objects by mistake fails
// at once instead of filling the daemon's memory.
func ListShards(ctx context.Context, b storage.Backend, prefix string, f Format, budget int64) ([]Shard, error) {
	shards, err := listObjects(ctx, b, prefix, budget, func(name string) bool { return f == Raw || strings.HasSuffix(name, ".tar") })
	if err != nil {
		return nil, err
	}
	if len(shards) == 0 {
		what := "objects"
		if f == WebDataset {
			what = ".tar shards"
		}
		return nil, fmt.Errorf("%w: %s has no %s under prefix %q", ErrInvalid, b.Location(), what, prefix)
	}
	return shards, nil
}

// listShardBytes is what a listed shard costs an iteration besides its
// name, measured (Go 1.26, world size 1, three epochs planned): the Shard
// in the list and in the rank's orders (~200 bytes), the cache's plan of
// its reads and its key (~300).
const listShardBytes = 512

// listCost is what listing a shard named name costs an iteration: its
// name is held in the list and in the cache's key.
func listCost(name string) int64 { return listShardBytes + 2*int64(len(name)) }
