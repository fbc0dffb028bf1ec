package prefetch

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// mixSources writes two tar datasets, "a" (4 shards of 5 samples) and
// "b" (2 shards of 5), under one folder, weighted 1 and 2.
func mixSources(t *testing.T) []MixSource {
	t.Helper()
	dir := t.TempDir()
	writeDataset(t, filepath.Join(dir, "a"), 4, 5, 10)
	writeDataset(t, filepath.Join(dir, "b"), 2, 5, 10)
	b := testdataBackend(t, dir)
	return []MixSource{{Backend: b, Prefix: "a/", Weight: 1}, {Backend: b, Prefix: "b/", Weight: 2}}
}

func mixKeys(t *testing.T, srcs []MixSource, c *Cache, spec Spec) []string {
	t.Helper()
	it, err := OpenMixture(context.Background(), srcs, c, spec, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var keys []string
	eachBatch(t, it, -1, func(b *Batch) {
		for _, s := range b.Samples {
			keys = append(keys, s.Key)
		}
	})
	return keys
}

// A mixture epoch takes each source's weight's share of the shards, and
// every source epoch delivers each of its samples exactly once across
// ranks, however its weight spreads it over mixture epochs: "a", a third
// of the reads (2 of 6 shards an epoch), takes two mixture epochs for one
// of its own; "b", two thirds, runs two of its epochs in each.
func TestMixtureSharesAndSourceEpochs(t *testing.T) {
	srcs := mixSources(t)
	c := newCache(t, 64<<20)
	perSource := map[string][]string{} // source → keys over mixture epochs 0 and 1
	for epoch := range int64(2) {
		var fromA, fromB int
		for rank := range 2 {
			for _, k := range mixKeys(t, srcs, c, Spec{BatchSize: 3, Rank: rank, WorldSize: 2, Seed: 4, Epoch: epoch, Even: EvenOff}) {
				src, key, _ := strings.Cut(k, "/")
				perSource[src] = append(perSource[src], key)
				if src == "0" {
					fromA++
				} else {
					fromB++
				}
			}
		}
		if fromA != 10 || fromB != 20 {
			t.Fatalf("epoch %d: %d samples from a, %d from b; want 10 and 20 (weights 1:2)", epoch, fromA, fromB)
		}
	}
	a := perSource["0"]
	slices.Sort(a)
	if len(a) != 20 || len(slices.Compact(slices.Clone(a))) != 20 {
		t.Fatalf("a's first epoch (mixture epochs 0-1): %d samples, %d distinct; want its 20 once each", len(a), len(slices.Compact(a)))
	}
	counts := map[string]int{}
	for _, k := range perSource["1"] {
		counts[k]++
	}
	for k, n := range counts {
		if n != 4 || len(counts) != 10 {
			t.Fatalf("b: sample %s delivered %d times over 4 of its epochs, %d distinct; want each 4 times", k, n, len(counts))
		}
	}
}

// A mixture's order is a function of the seed and epoch; resuming at a
// position replays its rest.
func TestMixtureDeterministicAndResumable(t *testing.T) {
	srcs := mixSources(t)
	c := newCache(t, 64<<20)
	spec := Spec{BatchSize: 4, WorldSize: 1, Seed: 9, Epoch: 3, ShuffleWindow: 8}
	first := mixKeys(t, srcs, c, spec)
	if again := mixKeys(t, srcs, c, spec); !slices.Equal(first, again) {
		t.Fatal("the same spec gave another order")
	}
	spec.Seed = 10
	if other := mixKeys(t, srcs, c, spec); slices.Equal(first, other) {
		t.Fatal("another seed gave the same order")
	}
	spec.Seed, spec.Start = 9, 12
	if tail := mixKeys(t, srcs, c, spec); !slices.Equal(tail, first[12:]) {
		t.Fatalf("resumed at 12: %v, want %v", tail, first[12:])
	}
}

// A mixture consumed in part at 2 ranks resumes at 3 from the union of
// their positions: every read of the epoch is delivered exactly once.
func TestMixtureElasticResume(t *testing.T) {
	srcs := mixSources(t)
	c := newCache(t, 64<<20)
	want := map[string]int{}
	for rank := range 2 {
		for _, k := range mixKeys(t, srcs, c, Spec{BatchSize: 3, Rank: rank, WorldSize: 2, Seed: 1, Epoch: 5, Even: EvenOff}) {
			want[k]++
		}
	}
	got := map[string]int{}
	union := NewDelivered()
	for rank := range 2 {
		it, err := OpenMixture(context.Background(), srcs, c, Spec{BatchSize: 3, Rank: rank, WorldSize: 2, Seed: 1, Epoch: 5, Even: EvenOff}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		keys, d := consume(t, it, 2)
		it.Close()
		for _, k := range keys {
			got[k]++
		}
		union.Union(d)
	}
	for rank := range 3 {
		it, err := OpenMixture(context.Background(), srcs, c, Spec{BatchSize: 3, Rank: rank, WorldSize: 3, Seed: 1, Epoch: 5, Even: EvenOff, Delivered: union}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		keys, _ := consume(t, it, -1)
		it.Close()
		for _, k := range keys {
			got[k]++
		}
	}
	for k, n := range want {
		if got[k] != n {
			t.Fatalf("sample %s delivered %d times over both runs, %d in one", k, got[k], n)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("%d samples delivered, want %d", len(got), len(want))
	}
}

// Sources of different formats and backends mix: tar shards with an MDS
// dataset, even epochs counting both.
func TestMixtureOfFormats(t *testing.T) {
	dir := t.TempDir()
	writeDataset(t, filepath.Join(dir, "tars"), 3, 4, 10)
	srcs := []MixSource{
		{Backend: testdataBackend(t, dir), Prefix: "tars/", Weight: 1},
		{Backend: testdataBackend(t, "testdata/mds"), Prefix: "zstd/", Format: MDS, Weight: 1},
	}
	c := newCache(t, 64<<20)
	var counts []int
	for rank := range 2 {
		counts = append(counts, len(mixKeys(t, srcs, c, Spec{BatchSize: 4, Rank: rank, WorldSize: 2, Seed: 2})))
	}
	if counts[0] != counts[1] || counts[0] == 0 {
		t.Fatalf("even pad gave ranks %v samples", counts)
	}
	for _, bad := range [][]MixSource{
		nil,
		{{Backend: srcs[0].Backend, Prefix: "tars/", Weight: 0}},
		{{Backend: srcs[0].Backend, Prefix: "none/", Weight: 1}},
		{{Backend: srcs[0].Backend, Prefix: "tars/", Format: "lance", Weight: 1}},
	} {
		if _, err := OpenMixture(context.Background(), bad, c, Spec{BatchSize: 1, WorldSize: 1}, Options{}); !errors.Is(err, ErrInvalid) {
			t.Errorf("mixture %+v: %v, want ErrInvalid", bad, err)
		}
	}
}

// A mixture's sources share one listing budget, charged for what each
// listing holds (an MDS shard's hashes, a Parquet file's footer), not
// only for the shards' names: the second source has what the first's
// shards left, to the byte.
func TestMixtureListingBudget(t *testing.T) {
	b := testdataBackend(t, "testdata")
	c := newCache(t, 64<<20)
	for _, tc := range []struct {
		prefix string
		format Format
	}{{"mds/zstd/", MDS}, {"parquet/", Parquet}} {
		one, _, err := listDataset(context.Background(), b, tc.prefix, tc.format, 1<<30, c)
		if err != nil {
			t.Fatal(err)
		}
		held := listedCost(one)
		if names := int64(len(one)) * listCost(one[0].Name); held <= names {
			t.Fatalf("%s: listed cost %d, no more than its names' %d", tc.prefix, held, names)
		}
		// lo: the smallest budget one source is listed in (the listing
		// of its objects may take more than what is kept of it).
		lo, hi := int64(1), int64(1<<20)
		for lo < hi {
			mid := (lo + hi) / 2
			if _, _, err := listDataset(context.Background(), b, tc.prefix, tc.format, mid, c); err == nil {
				hi = mid
			} else {
				lo = mid + 1
			}
		}
		srcs := []MixSource{{Backend: b, Prefix: tc.prefix, Format: tc.format, Weight: 1}, {Backend: b, Prefix: tc.prefix, Format: tc.format, Weight: 1}}
		spec := Spec{BatchSize: 1, WorldSize: 1}
		if _, err := OpenMixture(context.Background(), srcs, c, spec, Options{ListBytes: lo + held - 1}); !errors.Is(err, ErrTooLarge) {
			t.Errorf("%s twice in %d bytes of listing budget: %v, want ErrTooLarge", tc.prefix, lo+held-1, err)
		}
		it, err := OpenMixture(context.Background(), srcs, c, spec, Options{ListBytes: lo + held})
		if err != nil {
			t.Fatalf("%s twice in %d bytes: %v", tc.prefix, lo+held, err)
		}
		it.Close()
	}
}
