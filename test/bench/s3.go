package main

// The S3 rows: the same shard drained to and restored from a real MinIO
// started for the run, against minio-go moving the same bytes with the same
// parallelism and nothing else. Each repetition measures ckptd and its
// baselines back to back, so that load from elsewhere on the machine skews
// both alike.

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/internal/server"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
)

var s3Bench = flag.Bool("s3", true, "also benchmark S3 on a MinIO started for the run (skipped when MinIO is not installed: scripts/minio.sh)")

// restoreStreams is how many chunks a restore fetches at once: ckptd
// serve's default (checkpoint.ReadOptions).
const restoreStreams = 8

const bucket = "bench"

// s3Env is the MinIO server, the backend on it and a daemon using it.
type s3Env struct {
	cfg config
	srv *miniotest.Server
	b   *s3.Backend
	d   *daemon
}

// benchS3 returns the S3 rows, or none when MinIO is not installed.
func benchS3(cfg config, data []byte, work string) ([]row, error) {
	if !*s3Bench {
		return nil, nil
	}
	bin, err := miniotest.Binary()
	if err != nil {
		fmt.Printf("S3: skipped: %v\n", err)
		return nil, nil
	}
	srv, err := miniotest.Launch(bin, filepath.Join(work, "minio"))
	if err != nil {
		return nil, err
	}
	defer srv.Close()
	ctx := context.Background()
	if err := srv.CreateBucket(ctx, bucket); err != nil {
		return nil, err
	}
	b, err := s3.New(ctx, s3.Config{
		Bucket: bucket, Prefix: "ckpt", Endpoint: srv.Endpoint(), Region: miniotest.Region, Credentials: srv.Credentials(),
	})
	if err != nil {
		return nil, err
	}
	defer b.Close()
	d, err := startDaemonOn(cfg, b, work, "s3", 0, nil)
	if err != nil {
		return nil, err
	}
	defer d.close()
	fmt.Printf("S3: MinIO %s on %s, %d MiB parts, %d parts in flight, %d restore streams\n",
		srv.Endpoint(), filepath.Join(work, "minio"), s3.DefaultPartSize>>20, s3.DefaultPartConcurrency, restoreStreams)
	e := &s3Env{cfg: cfg, srv: srv, b: b, d: d}
	drain, err := e.benchDrain(data)
	if err != nil {
		return nil, err
	}
	restore, err := e.benchRestore()
	if err != nil {
		return nil, err
	}
	return append(drain, restore...), nil
}

// startDaemonOn starts an in-process daemon (the Manager and gRPC server of
// ckptd serve) on backend b, with its own arena and socket named by name,
// a hot tier of hotBytes and peers p (nil: none).
func startDaemonOn(cfg config, b storage.Backend, work, name string, hotBytes int64, p tiers.Peers) (*daemon, error) {
	a, err := arena.Open(arena.Options{Dir: fmt.Sprintf("/dev/shm/ckptd-bench-%s-%d", name, os.Getpid()), Size: cfg.size + 64<<20, Lock: true})
	if err != nil {
		return nil, err
	}
	mgr, err := staging.NewManager(server.CheckpointArena(a), b, staging.ManagerConfig{
		DefaultJob: "bench",
		Writer:     checkpoint.WriterOptions{ChunkSize: cfg.chunkSize, Codec: cfg.codec, Workers: cfg.workers, Incremental: cfg.incremental},
		Read:       checkpoint.ReadOptions{Concurrency: restoreStreams},
		Tiers:      tiers.Config{HotBytes: hotBytes, Peers: p},
	})
	if err != nil {
		_ = a.Remove()
		return nil, err
	}
	sock := filepath.Join(work, "ckptd-"+name+".sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	server.Register(srv, mgr, a, nil)
	go func() { _ = srv.Serve(lis) }()
	c, err := ckptd.Dial(sock)
	if err != nil {
		return nil, err
	}
	return &daemon{arena: a, mgr: mgr, srv: srv, client: c, store: b}, nil
}

// rate runs fn and returns n bytes over the time it took.
func rate(n int64, fn func() error) (float64, error) {
	start := time.Now()
	if err := fn(); err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// benchDrain times accepted → committed for cfg.runs saves, each followed
// by minio-go's parallel multipart PUT of the raw shard with the backend's
// part size and parallelism.
func (e *s3Env) benchDrain(data []byte) ([]row, error) {
	ctx := context.Background()
	size := int64(len(data))
	var drains, puts []float64
	for i := range e.cfg.runs {
		h, err := e.d.client.Save(ctx, request(int64(i+1), data))
		if err != nil {
			return nil, err
		}
		r, err := rate(size, func() error { return h.Wait(ctx) })
		if err != nil {
			return nil, err
		}
		drains = append(drains, r)
		r, err = rate(size, func() error {
			_, err := e.srv.Client().PutObject(ctx, bucket, "raw/shard", bytes.NewReader(data), size,
				minio.PutObjectOptions{PartSize: s3.DefaultPartSize, NumThreads: s3.DefaultPartConcurrency})
			return err
		})
		if err != nil {
			return nil, err
		}
		puts = append(puts, r)
	}
	fmt.Printf("S3 baseline: raw multipart PUT %.2f GB/s\n", median(puts)/1e9)
	return []row{{name: "S3 drain (vs raw multipart PUT)", unit: "GB/s", ckptd: median(drains) / 1e9, baseline: median(puts) / 1e9, target: ">= 0.9x"}}, nil
}

// benchRestore times BeginRestore of the last step, each run followed by
// the baselines on its data object: parallel ranged GETs of a part each
// (alone, and with the chunks decoded), and GETs of exactly the chunks'
// ranges through the backend and through minio-go, which isolates the
// cost of the backend's Get.
func (e *s3Env) benchRestore() ([]row, error) {
	ctx := context.Background()
	m, key, err := e.lastManifest()
	if err != nil {
		return nil, err
	}
	stored := make([]byte, m.StoredSize)
	out := make([]byte, m.DataSize)
	clear(stored) // fault the pages in now, as the arena's are
	clear(out)
	var restores, gets, decodes, backendChunks, rawChunks []float64
	for range e.cfg.runs {
		r, err := rate(m.DataSize, func() error { return e.restoreOnce(ctx) })
		if err != nil {
			return nil, err
		}
		restores = append(restores, r)
		steps := []struct {
			xs *[]float64
			n  int64
			fn func() error
		}{
			{&gets, m.DataSize, func() error { return e.rangedGet(ctx, key, stored) }},
			{&decodes, m.DataSize, func() error {
				if err := e.rangedGet(ctx, key, stored); err != nil {
					return err
				}
				return decodeAll(e.cfg, m, stored, out)
			}},
			{&backendChunks, m.StoredSize, func() error { return e.chunkGets(ctx, m, stored, e.backendGet("bench/"+m.Chunks[0].Object)) }},
			{&rawChunks, m.StoredSize, func() error { return e.chunkGets(ctx, m, stored, e.rawGet(key)) }},
		}
		for _, s := range steps {
			r, err := rate(s.n, s.fn)
			if err != nil {
				return nil, err
			}
			*s.xs = append(*s.xs, r)
		}
	}
	fmt.Printf("S3 baselines: parallel GET of %d MiB ranges %.2f GB/s; the same + %s decode %.2f GB/s; GETs of the %d chunks: backend %.2f, minio-go %.2f GB/s\n",
		s3.DefaultPartSize>>20, median(gets)/1e9, e.cfg.codec, median(decodes)/1e9, len(m.Chunks), median(backendChunks)/1e9, median(rawChunks)/1e9)
	restore := median(restores) / 1e9
	return []row{
		{name: "S3 restore (vs raw parallel GET)", unit: "GB/s", ckptd: restore, baseline: median(gets) / 1e9, target: ">= 0.9x"},
		{name: "S3 restore (vs raw parallel GET + decode)", unit: "GB/s", ckptd: restore, baseline: median(decodes) / 1e9, target: ">= 0.9x"},
		{name: "S3 chunk GETs (backend vs minio-go)", unit: "GB/s", ckptd: median(backendChunks) / 1e9, baseline: median(rawChunks) / 1e9, target: ">= 0.9x"},
	}, nil
}

func (e *s3Env) restoreOnce(ctx context.Context) error {
	api := e.d.client.API()
	resp, err := api.BeginRestore(ctx, &pb.BeginRestoreRequest{Step: int64(e.cfg.runs)})
	if err != nil {
		return err
	}
	_, err = api.ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: resp.GetLease().GetId()})
	return err
}

// lastManifest returns rank 0's manifest of the last step and the key of
// its data object.
func (e *s3Env) lastManifest() (*checkpoint.Manifest, string, error) {
	ctx := context.Background()
	store, err := checkpoint.NewStore(e.b, "bench")
	if err != nil {
		return nil, "", err
	}
	rec, err := store.Resolve(ctx, int64(e.cfg.runs), false)
	if err != nil {
		return nil, "", err
	}
	m, err := store.Manifest(ctx, rec, 0)
	if err != nil {
		return nil, "", err
	}
	return m, e.b.Prefix() + "bench/" + m.Chunks[0].Object, nil
}

// rangedGet fetches the object into dst with restoreStreams parallel
// ranged GETs of a part each.
func (e *s3Env) rangedGet(ctx context.Context, key string, dst []byte) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(restoreStreams)
	get := e.rawGet(key)
	for off := int64(0); off < int64(len(dst)); off += s3.DefaultPartSize {
		end := min(off+s3.DefaultPartSize, int64(len(dst)))
		g.Go(func() error { return get(gctx, dst[off:end], off) })
	}
	return g.Wait()
}

// chunkGets fetches each chunk's stored range with get, restoreStreams at
// once.
func (e *s3Env) chunkGets(ctx context.Context, m *checkpoint.Manifest, stored []byte, get func(context.Context, []byte, int64) error) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(restoreStreams)
	for _, c := range m.Chunks {
		g.Go(func() error { return get(gctx, stored[c.Offset:c.Offset+c.Stored], c.Offset) })
	}
	return g.Wait()
}

// rawGet reads len(dst) bytes at off with minio-go's GetObject.
func (e *s3Env) rawGet(key string) func(context.Context, []byte, int64) error {
	core := minio.Core{Client: e.srv.Client()}
	return func(ctx context.Context, dst []byte, off int64) error {
		opts := minio.GetObjectOptions{}
		if err := opts.SetRange(off, off+int64(len(dst))-1); err != nil {
			return err
		}
		body, _, _, err := core.GetObject(ctx, bucket, key, opts)
		if err != nil {
			return err
		}
		defer body.Close()
		_, err = io.ReadFull(body, dst)
		return err
	}
}

// backendGet reads len(dst) bytes at off of object name with the
// backend's Get, as a restore does.
func (e *s3Env) backendGet(name string) func(context.Context, []byte, int64) error {
	return func(ctx context.Context, dst []byte, off int64) error {
		rc, err := e.b.Get(ctx, name, off, int64(len(dst)))
		if err != nil {
			return err
		}
		defer rc.Close()
		_, err = io.ReadFull(rc, dst)
		return err
	}
}

func decodeAll(cfg config, m *checkpoint.Manifest, stored, out []byte) error {
	var g errgroup.Group
	g.SetLimit(cfg.workers)
	for _, c := range m.Chunks {
		g.Go(func() error {
			src := stored[c.Offset : c.Offset+c.Stored]
			dst := out[c.RawOffset : c.RawOffset : c.RawOffset+c.Raw]
			if c.Codec == codec.None {
				copy(dst[:c.Raw], src)
				return nil
			}
			_, err := codec.Decode(c.Codec, dst, src, int(c.Raw))
			return err
		})
	}
	return g.Wait()
}
