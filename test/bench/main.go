// Command bench measures ckptd's checkpoint path and prints a table of
// ratios against baselines taken in the same run on the same bytes (`make
// bench`). Absolute numbers on a shared machine are noise; ratios are what
// the targets are about.
//
//	save stall      Client.Save (begin, copy into the arena, commit) vs a
//	                memcpy of the same bytes into a warm shared-memory mapping
//	drain           accepted → committed, vs min(raw O_DIRECT write of the
//	                same bytes, the codec alone on the same chunks and cores)
//	restore         BeginRestore into the arena (fetch, verify, decompress)
//	hot restore     BeginRestore of a step the hot tier holds (verify, copy)
//	                vs a memcpy of the same bytes into warm shared memory
//	peers           restore from a peer sidecar (fetch over loopback TCP,
//	                verify, copy) and replication after commit, vs a raw
//	                loopback TCP transfer of the same bytes
//	start           opening a fresh arena (what a daemon's start waits on)
//	                vs a write of every page of a new shared-memory file
//	incremental     --incremental: bytes a save of a LoRA-like shard (1% of
//	                it trains) writes vs the first (full) save, and the
//	                drain time of a save where nothing repeats vs without it
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"

	"google.golang.org/grpc"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/posix"
)

type config struct {
	size      int64
	runs      int
	dir       string
	codec     codec.Codec
	chunkSize int64
	workers   int
	only      string
	// incremental starts daemons as serve --incremental does.
	incremental bool
}

// runs reports whether the part named is to run (-only).
func (c config) wants(part string) bool {
	return c.only == "" || slices.Contains(strings.Split(c.only, ","), part)
}

func main() {
	var cfg config
	var codecName string
	flag.Int64Var(&cfg.size, "size", 1<<30, "shard bytes")
	flag.IntVar(&cfg.runs, "runs", 3, "repetitions; the median is reported")
	flag.StringVar(&cfg.dir, "dir", ".bench", "folder on the disk to benchmark (storage and raw writes)")
	flag.StringVar(&codecName, "codec", "auto", "chunk codec (auto, as ckptd serve defaults to, or zstd, lz4, none, float-bf16)")
	flag.Int64Var(&cfg.chunkSize, "chunk-size", 4<<20, "chunk bytes")
	flag.IntVar(&cfg.workers, "workers", runtime.GOMAXPROCS(0), "compression workers")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile here")
	flag.StringVar(&cfg.only, "only", "", "run only these parts, comma-separated: save (save stall and drain), restore (needs save), hot, peer, s3, start, incremental")
	flag.Parse()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fail(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fail(err)
		}
		defer pprof.StopCPUProfile()
	}
	// As `ckptd serve` does: one processor more than compression workers,
	// so I/O goroutines run as soon as they wake.
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(cfg.workers + 1)
	}
	var err error
	if cfg.codec, err = codec.ParseSetting(codecName); err != nil {
		fail(err)
	}
	if err := run(cfg); err != nil {
		pprof.StopCPUProfile()
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}

// row is one line of the result table.
type row struct {
	name, unit      string
	ckptd, baseline float64
	target          string
}

func (r row) ratio() float64 { return r.ckptd / r.baseline }

func run(cfg config) error {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err := os.MkdirAll(cfg.dir, 0o755); err != nil {
		return err
	}
	work, err := os.MkdirTemp(cfg.dir, "run-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	fmt.Printf("ckptd benchmark: %s shard of bf16-like weights, codec %s, %d MiB chunks, %d workers, %d runs, storage %s\n",
		human(cfg.size), cfg.codec, cfg.chunkSize>>20, cfg.workers, cfg.runs, work)
	data := weights(cfg.size)

	d, err := startDaemon(cfg, work)
	if err != nil {
		return err
	}
	defer d.close()
	var rows []row
	parts := []struct {
		name string
		fn   func() ([]row, error)
	}{
		{"save", func() ([]row, error) { return benchSaveAndDrain(cfg, d, data, work) }},
		{"restore", func() ([]row, error) { return benchRestore(cfg, d, work) }},
		{"hot", func() ([]row, error) { return benchHotRestore(cfg, data, work) }},
		{"peer", func() ([]row, error) { return benchPeers(cfg, data, work) }},
		{"s3", func() ([]row, error) { return benchS3(cfg, data, work) }},
		{"start", func() ([]row, error) { return benchStart(cfg) }},
		{"incremental", func() ([]row, error) { return benchIncremental(cfg, data, work) }},
	}
	for _, p := range parts {
		if !cfg.wants(p.name) {
			continue
		}
		r, err := p.fn()
		if err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
		rows = append(rows, r...)
	}
	printTable(rows)
	return nil
}

// weights makes n bytes of bf16 values with the spread of trained weights:
// they compress a little, like the real thing, unlike zeros or noise.
func weights(n int64) []byte {
	b := make([]byte, n)
	var wg sync.WaitGroup
	parts := int64(runtime.GOMAXPROCS(0))
	per := (n / parts) &^ 1
	for p := range parts {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(p), 7))
			end := (p + 1) * per
			if p == parts-1 {
				end = n &^ 1
			}
			for i := p * per; i < end; i += 2 {
				f := math.Float32bits(float32(r.NormFloat64() * 0.02))
				binary.LittleEndian.PutUint16(b[i:], uint16(f>>16))
			}
		})
	}
	wg.Wait()
	return b
}

// daemon is an in-process ckptd: the same Manager and gRPC server as
// `ckptd serve`, on a unix socket, with a client that maps the arena.
type daemon struct {
	arena  *arena.Arena
	mgr    *staging.Manager
	srv    *grpc.Server
	client *ckptd.Client
	store  storage.Backend
}

func startDaemon(cfg config, work string) (*daemon, error) {
	b, err := posix.New(filepath.Join(work, "store"))
	if err != nil {
		return nil, err
	}
	return startDaemonOn(cfg, b, work, "local", 0, nil)
}

func (d *daemon) close() {
	d.client.Close()
	d.srv.Stop()
	d.mgr.Close(context.Background())
	_ = d.arena.Remove()
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func printTable(rows []row) {
	fmt.Println()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "metric\tckptd\tbaseline\tratio\ttarget\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%.3g %s\t%.3g %s\t%.2fx\t%s\t\n", r.name, r.ckptd, r.unit, r.baseline, r.unit, r.ratio(), r.target)
	}
	tw.Flush()
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%d B", n)
}
