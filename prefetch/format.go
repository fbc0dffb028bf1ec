package prefetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/storage"
)

// unit is what a shard of a container format knows besides its object:
// its sample count and how to decode it, from the dataset's metadata (an
// MDS index.json, a Parquet footer). Tar and raw shards have none.
type unit struct {
	// samples is the shard's sample count, as the metadata says; first is
	// the global index of its first sample (an MDS key).
	samples int
	first   int64
	// mem is what the shard takes in memory once decoded (a compressed
	// MDS shard's raw bytes, a Parquet row group rewritten uncompressed):
	// what the cache holds and the read-ahead budget is charged.
	mem int64
	// object and off: a part of an object (a Parquet row group), read as
	// Size bytes at off of object. object is "" for a whole object.
	object string
	off    int64

	mds *mdsShard
	pq  *pqRowGroup
}

// objectName is the object a shard's bytes are read from.
func (sh *Shard) objectName() string {
	if sh.unit != nil && sh.unit.object != "" {
		return sh.unit.object
	}
	return sh.Name
}

// offset is where the shard's bytes start in its object.
func (sh *Shard) offset() int64 {
	if sh.unit != nil {
		return sh.unit.off
	}
	return 0
}

// weight is what reading the shard whole costs the read-ahead budget: its
// bytes, and for a shard decoded into new memory (decompressed) those too,
// as both are held while it is decoded.
func (sh *Shard) weight() int64 {
	if sh.unit != nil && sh.unit.mem > 0 && sh.decoded() {
		return max(sh.Size+sh.unit.mem, 1)
	}
	return max(sh.Size, 1)
}

// decoded says a shard read whole is turned into other bytes (decompressed
// or rewritten) before it is parsed and cached.
func (sh *Shard) decoded() bool {
	switch {
	case sh.unit == nil:
		return false
	case sh.unit.pq != nil:
		return true
	case sh.unit.mds != nil:
		return sh.unit.mds.codec != ""
	}
	return false
}

// knownCount is the shard's sample count when its metadata says it.
func (sh *Shard) knownCount() (int, bool) {
	if sh.unit == nil {
		return 0, false
	}
	return sh.unit.samples, true
}

// listDataset lists the shards of the dataset under prefix in format f,
// telling the format when f is Auto: a folder holding .tar objects is
// WebDataset (as it always was), else one with an MDS index.json is MDS,
// else one holding .parquet objects is Parquet.
func listDataset(ctx context.Context, b storage.Backend, prefix string, f Format, budget int64, cache *Cache) ([]Shard, Format, error) {
	switch f {
	case WebDataset, Raw:
		shards, err := ListShards(ctx, b, prefix, f, budget)
		return shards, f, err
	case MDS:
		shards, err := listMDS(ctx, b, prefix, budget)
		return shards, f, err
	case Parquet:
		objs, err := listObjects(ctx, b, prefix, budget, isParquet)
		if err != nil {
			return nil, f, err
		}
		shards, err := listParquet(ctx, b, prefix, objs, budget, cache)
		return shards, f, err
	}
	// Auto: one listing tells tar from Parquet; MDS by its index.
	objs, err := listObjects(ctx, b, prefix, budget, func(name string) bool { return strings.HasSuffix(name, ".tar") || isParquet(name) })
	if err != nil {
		return nil, f, err
	}
	var tars, pqs []Shard
	for _, o := range objs {
		if isParquet(o.Name) {
			pqs = append(pqs, o)
		} else {
			tars = append(tars, o)
		}
	}
	if len(tars) > 0 {
		return tars, WebDataset, nil
	}
	shards, err := listMDS(ctx, b, prefix, budget)
	switch {
	case err == nil:
		return shards, MDS, nil
	case !errors.Is(err, errNoIndex):
		return nil, MDS, err
	case len(pqs) > 0:
		shards, err := listParquet(ctx, b, prefix, pqs, budget, cache)
		return shards, Parquet, err
	}
	return nil, f, fmt.Errorf("%w: %s has no .tar shards, no MDS index.json and no .parquet files under prefix %q; "+
		"name the format (raw reads every object as a sample)", ErrInvalid, b.Location(), printable(prefix))
}

// listedCost is what listDataset charged the listing budget for shards:
// listCost each, an MDS shard's hashes, a Parquet file's footer once. A
// mixture lists its sources within one budget, the rest of it each.
func listedCost(shards []Shard) int64 {
	var n int64
	footers := map[*pqFile]bool{}
	for _, sh := range shards {
		n += listCost(sh.Name)
		switch u := sh.unit; {
		case u == nil:
		case u.mds != nil:
			n += mdsCost(u.mds)
		case u.pq != nil && !footers[u.pq.file]:
			footers[u.pq.file] = true
			n += u.pq.file.cost
		}
	}
	return n
}

// listObjects lists the objects under prefix that keep says to keep, in
// the backend's (name) order, within budget: a listing that would cost an
// iteration more fails (see ListShards).
func listObjects(ctx context.Context, b storage.Backend, prefix string, limit int64, keep func(string) bool) ([]Shard, error) {
	var out []Shard
	var cost int64
	err := b.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		if !keep(oi.Name) {
			return nil
		}
		if cost += listCost(oi.Name); cost > limit {
			return budget.Wrap(fmt.Errorf("%w: dataset %s/%s lists more shards than the listing budget (%d) allows "+
				"(about %d shards of such names; each costs a session its name twice and ~%d bytes)",
				ErrTooLarge, b.Location(), printable(prefix), limit, limit/listCost(oi.Name), listShardBytes), budget.DatasetListing)
		}
		out = append(out, Shard{Name: oi.Name, Size: oi.Size, ModTime: oi.ModTime})
		return nil
	})
	if errors.Is(err, ErrTooLarge) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("list dataset %s/%s: %w", b.Location(), prefix, err)
	}
	return out, nil
}

// joinName is base in the folder prefix names ("" or ending in "/" or a
// folder name).
func joinName(prefix, base string) string {
	if prefix == "" || strings.HasSuffix(prefix, "/") {
		return prefix + base
	}
	return prefix + "/" + base
}

// readSmall reads a whole metadata object of at most limit bytes (an MDS
// index.json): a larger one is refused before it is read.
func readSmall(ctx context.Context, b storage.Backend, name string, size, limit int64, what string) ([]byte, error) {
	if size > limit {
		return nil, budget.Wrap(fmt.Errorf("%w: %s %s is %d bytes, more than the %d the listing budget reads",
			ErrTooLarge, what, printable(name), size, limit), budget.DatasetListing)
	}
	rc, err := b.Get(ctx, name, 0, size)
	if err != nil {
		return nil, fmt.Errorf("read %s %s: %w", what, printable(name), err)
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, size+1))
	if err != nil {
		return nil, fmt.Errorf("read %s %s: %w", what, printable(name), err)
	}
	if int64(len(data)) != size {
		return nil, fmt.Errorf("read %s %s: %d bytes, listed as %d (changed since?)", what, printable(name), len(data), size)
	}
	return data, nil
}

// decodeShard turns the bytes of a shard read whole into what is parsed
// and cached: an MDS shard checked against its hashes and decompressed, a
// Parquet row group rewritten with its pages uncompressed. Plain shards
// pass as they are.
func decodeShard(sh Shard, data shardBytes) (shardBytes, error) {
	// The bytes are read until the decoder returns: their mapping (a
	// pooled buffer, a file) must live as long, whatever the decoder
	// keeps of them.
	defer runtime.KeepAlive(data)
	switch {
	case sh.unit == nil:
		return data, nil
	case sh.unit.mds != nil:
		return decodeMDS(sh, data)
	case sh.unit.pq != nil:
		return decodePQ(sh, data)
	}
	return data, nil
}

// memSize is what the shard takes in memory once read and decoded.
func (sh *Shard) memSize() int64 {
	if sh.unit != nil && sh.unit.mem > 0 {
		return sh.unit.mem
	}
	return sh.Size
}

// streams says the shard can be parsed as it is read (all but Parquet row
// groups and snappy-compressed MDS shards, which are decoded whole).
func (sh *Shard) streams() bool {
	switch {
	case sh.unit == nil:
		return true
	case sh.unit.pq != nil:
		return false
	case sh.unit.mds != nil:
		return mdsStreams(sh.unit.mds)
	}
	return true
}

// streamed says whether a shard is parsed as it is read rather than read
// whole: one larger in memory than the read-ahead budget lets a shard be
// (Options.streamAbove) is. One that cannot be streamed is read whole
// while that fits the budget's part for shards, and is ErrTooLarge beyond.
func streamed(sh Shard, opts Options) (bool, error) {
	switch {
	case sh.memSize() <= opts.streamAbove():
		return false, nil
	case sh.streams():
		return true, nil
	case sh.weight() <= opts.readAhead():
		return false, nil
	}
	return false, budget.Wrap(fmt.Errorf("%w: shard %s takes %d bytes to read and decode whole, more than the %d bytes "+
		"the read-ahead budget (%d) leaves for shards read ahead; raise it, or write smaller shards (Parquet row groups)",
		ErrTooLarge, printable(sh.Name), sh.weight(), opts.readAhead(), opts.ReadAheadBytes), budget.ReadAhead)
}

func isParquet(name string) bool { return strings.HasSuffix(name, ".parquet") }
