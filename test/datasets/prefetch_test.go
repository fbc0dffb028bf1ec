package datasets

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// epoch reads one rank's epoch through the daemon and checks every sample.
func epoch(t *testing.T, c *ckptd.Client, req ckptd.DatasetRequest, want map[string]string) ([]string, ckptd.PrefetchStats) {
	t.Helper()
	ds, err := c.Dataset(daemontest.Ctx(t), &req)
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close(daemontest.Ctx(t))
	var keys []string
	for {
		batch, err := ds.Next(daemontest.Ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if batch == nil {
			return keys, ds.Stats()
		}
		for _, s := range batch {
			if string(s.Fields["txt"]) != want[s.Key] || len(s.Fields["cls"]) != 1 {
				t.Fatalf("sample %s: wrong bytes", s.Key)
			}
			keys = append(keys, s.Key)
		}
		if ds.Position() != req.Start+int64(len(keys)) {
			t.Fatalf("position %d after %d samples", ds.Position(), len(keys))
		}
	}
}

func TestPrefetchThroughDaemon(t *testing.T) {
	data := t.TempDir()
	want := daemontest.WriteShards(t, data, 6, 25)
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", data, "--slot-bytes", "64KiB", "--ring-slots", "3")
	c := d.Client()
	const world = 2
	var all []string
	var first []string
	for rank := range world {
		ks, st := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 8, Rank: rank, WorldSize: world, Seed: 5}, want)
		all = append(all, ks...)
		if rank == 0 {
			first = ks
		}
		if st.CacheMisses != 3 {
			t.Errorf("rank %d epoch 0: %+v", rank, st)
		}
	}
	slices.Sort(all)
	if len(all) != 150 || len(slices.Compact(all)) != 150 {
		t.Fatalf("%d samples, want each of 150 once", len(all))
	}
	// Resume mid-epoch: the tail of the same sequence.
	tail, _ := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 8, Rank: 0, WorldSize: world, Seed: 5, Start: 11}, want)
	if !slices.Equal(tail, first[11:]) {
		t.Fatal("resume at 11 is not the tail of the epoch")
	}
	// Epoch 1 comes from the cache and in another order.
	ks, st := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 8, Rank: 0, WorldSize: world, Seed: 5, Epoch: 1}, want)
	if st.CacheMisses != 0 || st.CacheHits != 3 || slices.Equal(ks, first) {
		t.Fatalf("epoch 1: %+v (same order: %v)", st, slices.Equal(ks, first))
	}
	// A batch larger than a slot is still delivered.
	big, _ := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 150, WorldSize: 1}, want)
	if len(big) != 150 {
		t.Fatalf("oversized batch: %d samples", len(big))
	}
}

func TestPrefetchBadInput(t *testing.T) {
	data := t.TempDir()
	daemontest.WriteShards(t, data, 2, 3)
	if err := os.WriteFile(filepath.Join(data, "train-999.tar"), []byte("truncated garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", filepath.Dir(data)) // the test's temporary folders
	c := d.Client()
	for _, tc := range []struct {
		req  ckptd.DatasetRequest
		code codes.Code
		msg  string
	}{
		{ckptd.DatasetRequest{Source: data, BatchSize: 0, WorldSize: 1}, codes.InvalidArgument, "batch_size"},
		{ckptd.DatasetRequest{Source: data, BatchSize: 1, Rank: 2, WorldSize: 2}, codes.InvalidArgument, "rank 2"},
		{ckptd.DatasetRequest{Source: t.TempDir(), BatchSize: 1, WorldSize: 1}, codes.InvalidArgument, "no .tar shards"},
		{ckptd.DatasetRequest{Source: "ftp://x/y", BatchSize: 1, WorldSize: 1}, codes.InvalidArgument, "unsupported scheme"},
	} {
		_, err := c.Dataset(daemontest.Ctx(t), &tc.req)
		if status.Code(daemontest.UnwrapStatus(err)) != tc.code || !strings.Contains(fmt.Sprint(err), tc.msg) {
			t.Errorf("%+v: %v, want %s %q", tc.req, err, tc.code, tc.msg)
		}
	}
	// The corrupt shard fails the epoch with its name, or is skipped.
	ds, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: data, BatchSize: 2, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	for err == nil {
		var b []ckptd.Sample
		if b, err = ds.Next(daemontest.Ctx(t)); b == nil && err == nil {
			t.Fatal("epoch ended without reporting the corrupt shard")
		}
	}
	if status.Code(daemontest.UnwrapStatus(err)) != codes.DataLoss || !strings.Contains(err.Error(), "train-999.tar") {
		t.Fatalf("corrupt shard: %v", err)
	}
	ks, st := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 2, WorldSize: 1, SkipCorrupt: true}, daemontest.WriteShards(t, data, 2, 3))
	if len(ks) != 6 || st.CorruptSkipped != 1 {
		t.Fatalf("skip corrupt: %d samples, %+v", len(ks), st)
	}
}

// A dataset whose listing would cost a session more than
// --dataset-list-bytes fails to open, naming the flag, and holds nothing
// after: a failed open gives its ring back, so however many fail, every
// session the arena's share fits can still open.
func TestPrefetchListingIsBounded(t *testing.T) {
	big, small := t.TempDir(), t.TempDir()
	daemontest.WriteShards(t, big, 20, 1)          // names of ~13 bytes: ~540 bytes of listing each
	want := daemontest.WriteShards(t, small, 3, 2) // ~1.6 KiB
	d := daemontest.StartEnv(t, "", nil, "--dataset-list-bytes", "4KiB", "--dataset-allow", big+","+small,
		"--dataset-arena-bytes", "128MiB") // two rings of 4 x 16 MiB
	c := d.Client()
	for range 5 {
		_, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: big, BatchSize: 1, WorldSize: 1})
		if status.Code(daemontest.UnwrapStatus(err)) != codes.ResourceExhausted || !strings.Contains(fmt.Sprint(err), "--dataset-list-bytes") {
			t.Fatalf("20 shards within 4 KiB of listing: %v, want RESOURCE_EXHAUSTED naming --dataset-list-bytes", err)
		}
	}
	var open []*ckptd.Dataset
	for range 2 {
		ds, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: small, BatchSize: 1, WorldSize: 1})
		if err != nil {
			t.Fatalf("after failed opens, a session the arena fits: %v", err)
		}
		open = append(open, ds)
	}
	for _, ds := range open {
		ds.Close(daemontest.Ctx(t))
	}
	if ks, _ := epoch(t, c, ckptd.DatasetRequest{Source: small, BatchSize: 2, WorldSize: 1}, want); len(ks) != 6 {
		t.Fatalf("small dataset: %d samples, want 6", len(ks))
	}
}

// Shards of a local source above 1 MiB are mapped, not read. One
// truncated while the daemon holds its mapping fails the epoch with
// DATA_LOSS where its bytes are read -- the kernel's SIGBUS becomes an
// error, not a crash -- and the daemon serves on.
func TestPrefetchTruncatedMappedShard(t *testing.T) {
	big, other := t.TempDir(), t.TempDir()
	for s := range 3 { // 15 samples of 100 KiB: 1.5 MiB shards, mapped
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for i := range 15 {
			data := bytes.Repeat([]byte{byte('a' + s)}, 100<<10)
			_ = tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("s%d/%02d.bin", s, i), Mode: 0o644, Size: int64(len(data))})
			_, _ = tw.Write(data)
		}
		_ = tw.Close()
		if err := os.WriteFile(filepath.Join(big, fmt.Sprintf("train-%d.tar", s)), buf.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want := daemontest.WriteShards(t, other, 2, 3)
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", big+","+other)
	c := d.Client()
	req := ckptd.DatasetRequest{Source: big, BatchSize: 4, WorldSize: 1}
	ds, err := c.Dataset(daemontest.Ctx(t), &req) // epoch 0: every shard mapped and cached
	if err != nil {
		t.Fatal(err)
	}
	for b := []ckptd.Sample{{}}; b != nil && err == nil; {
		b, err = ds.Next(daemontest.Ctx(t))
	}
	ds.Close(daemontest.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	req.Epoch = 1
	ds, err = c.Dataset(daemontest.Ctx(t), &req)
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close(daemontest.Ctx(t))
	if _, err := ds.Next(daemontest.Ctx(t)); err != nil { // the daemon is at most ~28 samples in: shard 3 of 3 is not read yet
		t.Fatal(err)
	}
	for s := range 3 {
		if err := os.Truncate(filepath.Join(big, fmt.Sprintf("train-%d.tar", s)), 0); err != nil {
			t.Fatal(err)
		}
	}
	for b := []ckptd.Sample{{}}; b != nil && err == nil; {
		b, err = ds.Next(daemontest.Ctx(t))
	}
	if status.Code(daemontest.UnwrapStatus(err)) != codes.DataLoss || !strings.Contains(fmt.Sprint(err), "changed while it was read") {
		t.Fatalf("epoch over truncated mapped shards: %v, want DATA_LOSS saying the shard changed", err)
	}
	if ks, _ := epoch(t, c, ckptd.DatasetRequest{Source: other, BatchSize: 2, WorldSize: 1}, want); len(ks) != 6 {
		t.Fatalf("after the fault, another dataset: %d samples, want 6", len(ks))
	}
}

// A dataset on a storage server that does not answer fails UNAVAILABLE
// (it may come back; the request was fine), and while the daemon retries
// it, datasets on other sources are served without waiting for it.
func TestPrefetchDeadSource(t *testing.T) {
	data := t.TempDir()
	want := daemontest.WriteShards(t, data, 2, 3)
	dead := "http://" + daemontest.ClosedAddr(t)
	d := daemontest.StartEnv(t, "", []string{"AWS_ACCESS_KEY_ID=k", "AWS_SECRET_ACCESS_KEY=s"},
		"--s3-endpoint", dead, "--s3-region", "us-east-1", "--s3-retry-deadline", "10s", "--dataset-allow", data+",s3://bucket")
	c := d.Client()
	deadErr := make(chan error, 1)
	go func() {
		_, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: "s3://bucket/shards", BatchSize: 1, WorldSize: 1})
		deadErr <- err
	}()
	time.Sleep(500 * time.Millisecond) // let the dead source's open start retrying
	ks, _ := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 2, WorldSize: 1}, want)
	select {
	case err := <-deadErr:
		t.Fatalf("the dead source answered (%v) before the live one was served: opens are serialized", err)
	default:
	}
	if len(ks) != 6 {
		t.Fatalf("live source: %d samples, want 6", len(ks))
	}
	err := <-deadErr
	if status.Code(daemontest.UnwrapStatus(err)) != codes.Unavailable || !strings.Contains(fmt.Sprint(err), "storage unavailable") ||
		!strings.Contains(fmt.Sprint(err), dead) {
		t.Fatalf("dead source: %v, want UNAVAILABLE naming the endpoint", err)
	}
}

// Dataset rings take at most --dataset-arena-bytes (default half the
// arena): however many sessions open, a checkpoint save still finds room.
func TestPrefetchRingsLeaveRoomForSaves(t *testing.T) {
	data := t.TempDir()
	want := daemontest.WriteShards(t, data, 2, 10)
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", data, "--staging-bytes", "32MiB", "--staging-wait", "1s", "--ring-slots", "2", "--slot-bytes", "4MiB")
	c := d.Client()
	var open []*ckptd.Dataset
	for range 2 {
		ds, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: data, BatchSize: 4, WorldSize: 1})
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, ds)
	}
	_, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: data, BatchSize: 4, WorldSize: 1})
	if status.Code(daemontest.UnwrapStatus(err)) != codes.ResourceExhausted || !strings.Contains(fmt.Sprint(err), "--dataset-arena-bytes") {
		t.Fatalf("a third 8 MiB ring in a 16 MiB share: %v, want RESOURCE_EXHAUSTED naming --dataset-arena-bytes", err)
	}
	h, err := c.Save(daemontest.Ctx(t), daemontest.Shard(1, 0, 1)) // 6 MiB
	if err != nil {
		t.Fatalf("a save with the datasets' share in use: %v", err)
	}
	if err := h.Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	for _, ds := range open {
		_ = ds.Close(daemontest.Ctx(t))
	}
	if ks, _ := epoch(t, c, ckptd.DatasetRequest{Source: data, BatchSize: 4, WorldSize: 1}, want); len(ks) != 20 {
		t.Fatalf("after closing: %d samples", len(ks))
	}
}

// Datasets are read with the daemon's identity, so only the sources
// --dataset-allow lists may be: not a folder outside it, not one reached
// through ".." or a link, not the daemon's own arena, not another bucket.
func TestPrefetchSourcesAreDenyByDefault(t *testing.T) {
	root := t.TempDir()
	data, outside := filepath.Join(root, "data"), filepath.Join(root, "outside")
	for _, dir := range []string{data, outside} {
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	want := daemontest.WriteShards(t, data, 1, 3)
	secret := daemontest.WriteShards(t, outside, 1, 3)
	if err := os.Symlink(outside, filepath.Join(data, "link")); err != nil {
		t.Fatal(err)
	}
	req := func(source string) *ckptd.DatasetRequest {
		return &ckptd.DatasetRequest{Source: source, BatchSize: 10, WorldSize: 1}
	}
	// No --dataset-allow: no datasets at all, and the error says how to allow some.
	d := daemontest.StartEnv(t, "", nil)
	_, err := d.Client().Dataset(daemontest.Ctx(t), req(data))
	if status.Code(daemontest.UnwrapStatus(err)) != codes.PermissionDenied || !strings.Contains(fmt.Sprint(err), "--dataset-allow") {
		t.Fatalf("no --dataset-allow: %v, want PERMISSION_DENIED naming the flag", err)
	}
	d.Stop()

	d = daemontest.StartEnv(t, "", nil, "--dataset-allow", data+",s3://bucket/team-a", "--dataset-allow", "/dev/shm")
	c := d.Client()
	if ks, _ := epoch(t, c, *req(data), want); len(ks) != 3 {
		t.Fatalf("the allowed folder: %d samples", len(ks))
	}
	for _, source := range []string{
		outside,
		data + "/../outside",
		data + "/link",
		"file://" + data + "/link",
		d.Arena,                 // beneath an allowed folder, yet never a source
		d.Arena + "/journal",    // the journal of staged saves
		"/dev/shm",              // it holds the arena
		root + "/data-and-more", // /data does not allow /data-and-more
		"s3://bucket/team-b",
		"s3://other/team-a",
		"s3://bucket/team-a-and-more",
	} {
		_, err := c.Dataset(daemontest.Ctx(t), req(source))
		if status.Code(daemontest.UnwrapStatus(err)) != codes.PermissionDenied || !strings.Contains(fmt.Sprint(err), "not allowed") {
			t.Errorf("%s: %v, want PERMISSION_DENIED", source, err)
		}
		for key := range secret {
			if strings.Contains(fmt.Sprint(err), key) {
				t.Errorf("%s: the error shows a sample outside the allowed folder", source)
			}
		}
	}
}

// A client whose calls time out (and retries) loses no ring slot: with two
// slots, a few leaked deliveries would stall the epoch for good.
func TestPrefetchTimedOutCallsLeakNoSlot(t *testing.T) {
	data := t.TempDir()
	want := daemontest.WriteShards(t, data, 4, 25)
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", data, "--ring-slots", "2", "--slot-bytes", "64KiB")
	c := d.Client()
	ds, err := c.Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: data, BatchSize: 2, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close(daemontest.Ctx(t))
	seen := map[string]bool{}
	timeouts := 0
	for i := 0; ; i++ {
		for j := range 4 { // deadlines from 0 to 1.5 ms: some expire as the batch is answered
			ctx, cancel := context.WithTimeout(daemontest.Ctx(t), time.Duration(j)*500*time.Microsecond)
			batch, err := ds.Next(ctx)
			cancel()
			if err != nil {
				timeouts++
				continue
			}
			if batch == nil {
				break
			}
			for _, s := range batch {
				if seen[s.Key] || string(s.Fields["txt"]) != want[s.Key] {
					t.Fatalf("sample %s: delivered twice or wrong", s.Key)
				}
				seen[s.Key] = true
			}
		}
		batch, err := ds.Next(daemontest.Ctx(t))
		if err != nil {
			t.Fatalf("after %d timed-out calls: %v", timeouts, err)
		}
		if batch == nil {
			break
		}
		for _, s := range batch {
			if seen[s.Key] {
				t.Fatalf("sample %s delivered twice", s.Key)
			}
			seen[s.Key] = true
		}
	}
	t.Logf("%d of %d samples delivered; %d calls timed out", len(seen), len(want), timeouts)
	if timeouts == 0 {
		t.Fatal("no call timed out: the test tested nothing")
	}
}

// The dataset service's memory is bounded by its flags, not by the data:
// a 300 MiB shard, samples of 3 MiB and a shuffle window of 100000 go
// through a daemon whose prefetch ceiling is 16 MiB of cache plus two
// sessions of 32 MiB, and its peak RSS (VmHWM) stays under the arena, the
// ceiling and a fixed margin for the Go runtime, gRPC and the checkpoint
// side (memMargin), while every sample is delivered exactly once.
func TestPrefetchMemoryIsBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a daemon without the race detector and streams 400 MiB")
	}
	data := t.TempDir()
	const big, per = 100, 3 << 20 // the large shard: 100 samples of 3 MiB
	writeSparseShard(t, filepath.Join(data, "big.tar"), big, per)
	want := daemontest.WriteShards(t, data, 24, 8) // and small shards, read whole and cached
	for i := range big {
		want[fmt.Sprintf("big/%04d", i)] = ""
	}
	const (
		staging   = 64 << 20
		cache     = 16 << 20
		readAhead = 32 << 20
		sessions  = 2        // --dataset-arena-bytes 32MiB / (2 slots × 8 MiB)
		memMargin = 64 << 20 // the Go runtime, gRPC, the checkpoint side, and the garbage collector's headroom
	)
	// The race detector multiplies memory: measure a plain build.
	d := daemontest.New(t, "", "", append(append([]string{}, daemontest.DefaultArgs...), "--dataset-allow", data, "--staging-bytes", "64MiB",
		"--cache-bytes", "16MiB", "--read-ahead-bytes", "32MiB", "--ring-slots", "2", "--slot-bytes", "8MiB", "--dataset-arena-bytes", "32MiB")...)
	d.Bin = daemontest.PlainBin(t)
	d.Start()
	idle := peakRSS(t, d.Cmd.Process.Pid)
	c := d.Client()
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	errs := make(chan error, sessions)
	for rank := range sessions {
		wg.Go(func() {
			errs <- readAll(c, data, rank, sessions, func(s ckptd.Sample) error {
				mu.Lock()
				defer mu.Unlock()
				if seen[s.Key] {
					return fmt.Errorf("sample %s delivered twice", s.Key)
				}
				seen[s.Key] = true
				return checkSample(s, want, per)
			})
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(seen) != len(want) {
		t.Fatalf("%d samples delivered, want %d", len(seen), len(want))
	}
	hwm := peakRSS(t, d.Cmd.Process.Pid)
	bound := int64(staging + cache + sessions*(readAhead+2*4<<20+256<<10) + memMargin)
	t.Logf("peak RSS %d MiB (%d MiB once started); bound %d MiB (arena 64 + cache 16 + 2 sessions × 40.25 + margin 64)", hwm>>20, idle>>20, bound>>20)
	if hwm > bound {
		t.Fatalf("peak RSS %d MiB is over the bound of %d MiB", hwm>>20, bound>>20)
	}
}

// writeSparseShard writes a WebDataset tar of n samples of size bytes
// ("big/NNNN.bin"), sparse on disk: each sample's data is a hole but for
// its index in its first bytes.
func writeSparseShard(t *testing.T, path string, n, size int) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var off int64
	for i := range n {
		var hdr bytes.Buffer
		tw := tar.NewWriter(&hdr)
		_ = tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("big/%04d.bin", i), Mode: 0o644, Size: int64(size)})
		// WriteHeader wrote the 512-byte header; the data follows it.
		if _, err := f.WriteAt(hdr.Bytes()[:512], off); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(binary.LittleEndian.AppendUint64(nil, uint64(i)), off+512); err != nil {
			t.Fatal(err)
		}
		off += 512 + int64(size+511)&^511
	}
	if err := f.Truncate(off + 1024); err != nil { // the end-of-archive marker: two zero blocks
		t.Fatal(err)
	}
}

// checkSample checks a sample of writeShards or writeSparseShard.
func checkSample(s ckptd.Sample, want map[string]string, size int) error {
	if !strings.HasPrefix(s.Key, "big/") {
		if string(s.Fields["txt"]) != want[s.Key] {
			return fmt.Errorf("sample %s: wrong bytes", s.Key)
		}
		return nil
	}
	var i uint64
	fmt.Sscanf(s.Key, "big/%d", &i)
	bin := s.Fields["bin"]
	if len(bin) != size || binary.LittleEndian.Uint64(bin) != i || bin[size-1] != 0 {
		return fmt.Errorf("sample %s: wrong bytes", s.Key)
	}
	return nil
}

// readAll reads one rank's epoch with a window far larger than the budget.
func readAll(c *ckptd.Client, source string, rank, world int, check func(ckptd.Sample) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ds, err := c.Dataset(ctx, &ckptd.DatasetRequest{Source: source, BatchSize: 2, Rank: rank, WorldSize: world, ShuffleWindow: 100000, Even: "off"})
	if err != nil {
		return err
	}
	defer ds.Close(ctx)
	for {
		batch, err := ds.Next(ctx)
		if err != nil || batch == nil {
			return err
		}
		for _, s := range batch {
			if err := check(s); err != nil {
				return err
			}
		}
	}
}

// peakRSS is a process's peak resident set (VmHWM).
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(status)) {
		if kb, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var n int64
			fmt.Sscanf(strings.TrimSpace(kb), "%d kB", &n)
			return n << 10
		}
	}
	t.Fatal("no VmHWM in /proc/<pid>/status")
	return 0
}

// `ckptd status` shows each dataset session's ring (slots now, and what
// it may grow to) and its read-ahead (held, and the pacer's target).
func TestStatusShowsDatasetRings(t *testing.T) {
	data := t.TempDir()
	daemontest.WriteShards(t, data, 4, 10)
	d := daemontest.StartEnv(t, "", nil, "--dataset-allow", data, "--slot-bytes", "64KiB", "--ring-slots", "2", "--ring-slots-max", "5")
	ds, err := d.Client().Dataset(daemontest.Ctx(t), &ckptd.DatasetRequest{Source: data, BatchSize: 2, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ds.Close(context.Background())
	if _, err := ds.Next(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	st := daemontest.StatusJSON(t, d.Socket)
	if len(st.GetDatasets()) != 1 {
		t.Fatalf("%d dataset sessions in the status; want 1", len(st.GetDatasets()))
	}
	s := st.GetDatasets()[0]
	if s.GetRingSlots() != 2 || s.GetRingSlotsMax() != 5 || s.GetReadAheadTarget() <= 0 {
		t.Fatalf("dataset session %v: want a ring of 2 of 5 slots and a read-ahead target", s)
	}
	out, stderr, err := daemontest.CLI(t, "status", "--socket", d.Socket)
	if err != nil {
		t.Fatalf("ckptd status: %v\n%s", err, stderr)
	}
	for _, want := range []string{"DATASETS (1)", "RING SLOTS", "2 of 5", "READ AHEAD"} {
		if !strings.Contains(out, want) {
			t.Fatalf("ckptd status lacks %q:\n%s", want, out)
		}
	}
}
