package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/ckptd/ckptd/checkpoint/tiers"
	"github.com/ckptd/ckptd/internal/peers"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage/posix"
)

// benchPeers runs three in-process sidecars of one job on loopback TCP,
// sharing a store: the saver's shard is replicated to its holder (timed
// from the save's commit until the holder has it), and the third sidecar,
// which holds no copy, restores it from the holder (fetch, verify, copy
// into its arena). Both against a raw loopback TCP transfer of as many
// bytes. Plaintext: mutual TLS's cost is not in these figures.
func benchPeers(cfg config, data []byte, work string) ([]row, error) {
	ctx := context.Background()
	b, err := posix.New(filepath.Join(work, "peerstore"))
	if err != nil {
		return nil, err
	}
	addrs, err := freeAddrs(3)
	if err != nil {
		return nil, err
	}
	slices.Sort(addrs) // rank 0's replica then lives at addrs[1]: see peers.Holders
	hot := cfg.size + 64<<20
	var ds []*daemon
	for i, addr := range addrs {
		pc := peers.NewClient(addrs, addr, 1, peers.Creds{GRPC: insecure.NewCredentials()}, slog.Default())
		d, err := startDaemonOn(cfg, b, work, fmt.Sprintf("peer%d", i), hot, pc)
		if err != nil {
			return nil, err
		}
		defer d.close()
		defer pc.Close()
		_, stop, err := peers.Listen(addr, peers.Creds{GRPC: insecure.NewCredentials()}, peers.NewServer(d.mgr.PeerSide(), hot).Members(pc))
		if err != nil {
			return nil, err
		}
		defer stop()
		ds = append(ds, d)
	}
	saver, holder, restorer := ds[0], ds[1], ds[2]
	if h := peers.Holders(addrs, addrs[0], 0, 1); h[0] != addrs[1] {
		return nil, fmt.Errorf("rank 0's replica goes to %s, not %s", h[0], addrs[1])
	}
	var repl, fetch []float64
	for i := range cfg.runs {
		step := int64(i + 1)
		h, err := saver.client.Save(ctx, request(step, data))
		if err != nil {
			return nil, err
		}
		if err := h.Wait(ctx); err != nil {
			return nil, err
		}
		start := time.Now()
		if err := waitHeld(holder, step); err != nil {
			return nil, err
		}
		repl = append(repl, time.Since(start).Seconds())
		start = time.Now()
		resp, err := restorer.client.API().BeginRestore(ctx, &pb.BeginRestoreRequest{Step: step})
		if err != nil {
			return nil, err
		}
		fetch = append(fetch, time.Since(start).Seconds())
		if _, err := restorer.client.API().ReleaseRegion(ctx, &pb.ReleaseRegionRequest{LeaseId: resp.GetLease().GetId()}); err != nil {
			return nil, err
		}
		if tier := resp.GetHeader().GetTier(); tier != "peer" {
			return nil, fmt.Errorf("the third sidecar restored from %q, not a peer", tier)
		}
	}
	tcp, err := tcpBaseline(cfg, data)
	if err != nil {
		return nil, err
	}
	size := float64(len(data))
	fmt.Printf("peers: replication %.2f GB/s, restore from a peer %.2f GB/s; loopback TCP %.2f GB/s\n",
		size/median(repl)/1e9, size/median(fetch)/1e9, size/tcp/1e9)
	return []row{
		{name: "restore from a peer (vs loopback TCP)", unit: "GB/s", ckptd: size / median(fetch) / 1e9, baseline: size / tcp / 1e9, target: ">= 0.8x"},
		{name: "replication after commit (vs loopback TCP)", unit: "GB/s", ckptd: size / median(repl) / 1e9, baseline: size / tcp / 1e9, target: "(report)"},
	}, nil
}

// waitHeld waits until d's hot tier holds step (of the bench job).
func waitHeld(d *daemon, step int64) error {
	for deadline := time.Now().Add(5 * time.Minute); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		held, err := d.mgr.PeerSide().Inventory("bench")
		if err != nil {
			return err
		}
		if slices.ContainsFunc(held, func(h tiers.HeldShard) bool { return h.Step == step }) {
			return nil
		}
	}
	return errors.New("the replica never arrived")
}

// tcpBaseline times sending data over a loopback TCP connection into a
// warm buffer, cfg.runs times, and returns the median.
func tcpBaseline(cfg config, data []byte) (float64, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write(data)
			c.Close()
		}
	}()
	buf := make([]byte, len(data))
	copy(buf, data) // warm
	var ts []float64
	for range cfg.runs {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			return 0, err
		}
		start := time.Now()
		_, err = io.ReadFull(c, buf)
		ts = append(ts, time.Since(start).Seconds())
		c.Close()
		if err != nil {
			return 0, err
		}
	}
	return median(ts), nil
}

// freeAddrs returns n loopback addresses free a moment ago.
func freeAddrs(n int) ([]string, error) {
	var out []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		out = append(out, l.Addr().String())
		l.Close()
	}
	return out, nil
}
