// Command floatcodec measures ckptd's chunk codecs on tensors dumped by
// bench.py (next to this file) and prints one table with zipnn's figures,
// measured by bench.py on the same bytes, alongside. Run it through
// `make bench` or `bench.py`, which train the model that makes the
// tensors; on its own: go run ./test/bench/floatcodec -dir DIR.
//
// Each data set is cut into chunks the way the drain cuts a shard (4 MiB,
// one dtype), every codec compresses every chunk on one goroutine, and a
// chunk that does not shrink counts as stored raw, as the writer stores it.
// Throughput is per core: raw bytes over the best of -runs passes.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"text/tabwriter"
	"time"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
)

type index struct {
	Steps int       `json:"steps"`
	Sets  []dataSet `json:"sets"`
}

type dataSet struct {
	Name  string      `json:"name"`
	DType dtype.DType `json:"dtype"`
	File  string      `json:"file"`
	Bytes int64       `json:"bytes"`
	ZipNN zipnnResult `json:"zipnn"`
}

type zipnnResult struct {
	Error       string  `json:"error"`
	Stored      int64   `json:"stored"`
	CompressS   float64 `json:"compress_s"`
	DecompressS float64 `json:"decompress_s"`
}

// targets are what the float codec must reach: its ratio on each set, and
// per-core speed on bf16.
var targets = map[string]float64{
	"bf16 weights": 1.48, "fp32 weights": 1.19, "fp32 upcast from bf16": 2.5,
	"adam exp_avg": 1.15, "adam exp_avg_sq": 1.15,
}

const (
	bf16CompressTarget   = 0.6 // GB/s per core
	bf16DecompressTarget = 1.0
)

// result is one codec on one data set.
type result struct {
	raw, stored          int64
	compress, decompress time.Duration
}

func (r result) ratio() float64 { return float64(r.raw) / float64(r.stored) }

func gbps(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }

func main() {
	dir := flag.String("dir", "", "folder with index.json and the tensors bench.py dumped")
	runs := flag.Int("runs", 3, "passes; the fastest is reported")
	chunk := flag.Int("chunk-size", 4<<20, "chunk bytes")
	flag.Parse()
	if err := run(*dir, *runs, *chunk); err != nil {
		fmt.Fprintln(os.Stderr, "floatcodec:", err)
		os.Exit(1)
	}
}

func run(dir string, runs, chunk int) error {
	if dir == "" {
		return errors.New("-dir is required (bench.py makes it)")
	}
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		return err
	}
	var idx index
	if err := json.Unmarshal(b, &idx); err != nil {
		return fmt.Errorf("index.json: %w", err)
	}
	runtime.LockOSThread() // one core, one thread: per-core figures
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "data set\tMB\tcodec\tratio\tcompress GB/s/core\tdecompress GB/s/core\ttarget\t\n")
	for _, s := range idx.Sets {
		if err := benchSet(tw, dir, s, runs, chunk); err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
	}
	return tw.Flush()
}

func benchSet(tw *tabwriter.Writer, dir string, s dataSet, runs, chunk int) error {
	data, err := os.ReadFile(filepath.Join(dir, s.File))
	if err != nil {
		return err
	}
	chunks := cut(data, chunk)
	for _, c := range []codec.Codec{codec.ForDType(s.DType), codec.Zstd, codec.LZ4} {
		r, err := measure(c, chunks, runs)
		if err != nil {
			return fmt.Errorf("%s: %w", c, err)
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%s\t%.3fx\t%.2f\t%.2f\t%s\t\n", s.Name, float64(len(data))/1e6, c, r.ratio(),
			gbps(r.raw, r.compress), gbps(r.raw, r.decompress), verdict(s, c, r))
	}
	z := s.ZipNN
	if z.Error != "" {
		fmt.Fprintf(tw, "%s\t\tzipnn\t%s\t\t\t\t\n", s.Name, z.Error)
		return nil
	}
	fmt.Fprintf(tw, "%s\t%.1f\tzipnn\t%.3fx\t%.2f\t%.2f\t\t\n", s.Name, float64(s.Bytes)/1e6,
		float64(s.Bytes)/float64(z.Stored), float64(s.Bytes)/z.CompressS/1e9, float64(s.Bytes)/z.DecompressS/1e9)
	return nil
}

// verdict compares the float codec's row with its targets (the targets table above).
func verdict(s dataSet, c codec.Codec, r result) string {
	want, ok := targets[s.Name]
	if !ok || c != codec.ForDType(s.DType) {
		return ""
	}
	v := fmt.Sprintf(">= %.2fx", want)
	pass := r.ratio() >= want
	if s.DType == dtype.BF16 {
		v += fmt.Sprintf(", >= %.1f/%.1f GB/s", bf16CompressTarget, bf16DecompressTarget)
		pass = pass && gbps(r.raw, r.compress) >= bf16CompressTarget && gbps(r.raw, r.decompress) >= bf16DecompressTarget
	}
	if pass {
		return v + " ok"
	}
	return v + " MISSED"
}

func cut(data []byte, size int) [][]byte {
	var out [][]byte
	for len(data) > 0 {
		n := min(size, len(data))
		out = append(out, data[:n])
		data = data[n:]
	}
	return out
}

// measure compresses and decompresses every chunk runs times, keeping the
// fastest pass of each, and checks the round trip.
func measure(c codec.Codec, chunks [][]byte, runs int) (result, error) {
	enc := make([][]byte, len(chunks))
	for i, ch := range chunks {
		enc[i] = make([]byte, 0, codec.MaxEncodedLen(c, len(ch)))
	}
	dec := make([]byte, 0, len(chunks[0]))
	r := result{compress: time.Hour, decompress: time.Hour}
	for range runs {
		start := time.Now()
		for i, ch := range chunks {
			var err error
			if enc[i], err = codec.Encode(c, enc[i], ch); err != nil {
				return r, err
			}
		}
		r.compress = min(r.compress, time.Since(start))
		start = time.Now()
		for i, ch := range chunks {
			if _, err := codec.Decode(c, dec, enc[i], len(ch)); err != nil {
				return r, err
			}
		}
		r.decompress = min(r.decompress, time.Since(start))
	}
	r.raw, r.stored = 0, 0
	for i, ch := range chunks {
		out, err := codec.Decode(c, dec, enc[i], len(ch))
		if err != nil || string(out) != string(ch) {
			return r, fmt.Errorf("chunk %d does not round-trip: %v", i, err)
		}
		r.raw += int64(len(ch))
		r.stored += int64(min(len(enc[i]), len(ch))) // the writer stores raw what does not shrink
	}
	return r, nil
}
