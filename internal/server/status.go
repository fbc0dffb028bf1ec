package server

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/peercred"
	"github.com/ckptd/ckptd/prefetch"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// StatusConfig is what the Daemon service reports besides the cores'
// snapshots.
type StatusConfig struct {
	Version string
	Started time.Time
	// Storage reports whether the checkpoint store answered the last
	// readiness probe, and why not.
	Storage func(ctx context.Context) error
	// BackendErrors returns the failed operations so far by backend:
	// "store", "dataset", "peers".
	BackendErrors func() map[string]uint64
}

// Daemon adapts the cores' snapshots to the Daemon service (`ckptd status`).
type Daemon struct {
	pb.UnimplementedDaemonServer
	mgr *staging.Manager
	pf  *prefetch.Service
	cfg StatusConfig
}

// RegisterDaemon registers the Daemon service on s.
func RegisterDaemon(s grpc.ServiceRegistrar, mgr *staging.Manager, pf *prefetch.Service, cfg StatusConfig) {
	pb.RegisterDaemonServer(s, &Daemon{mgr: mgr, pf: pf, cfg: cfg})
}

func (d *Daemon) GetStatus(ctx context.Context, _ *pb.GetStatusRequest) (*pb.DaemonStatus, error) {
	now := time.Now()
	cs, ps := d.mgr.Snapshot(), d.pf.Snapshot()
	st := &pb.DaemonStatus{
		Version: d.cfg.Version, UptimeSeconds: now.Sub(d.cfg.Started).Seconds(), DefaultJob: d.mgr.DefaultJob(),
		Storage: d.mgr.Backend().Location(), StorageReady: true, Errors: cs.Errors,
		Arena: &pb.ArenaUsage{
			Size: uint64(cs.ArenaSize), Used: uint64(cs.ArenaUsed), Staging: uint64(cs.Staging),
			Restores: uint64(cs.Restoring), Held: uint64(cs.Held),
			Datasets: uint64(ps.ArenaUsed), DatasetsShare: uint64(ps.ArenaShare),
		},
	}
	st.Hot = &pb.HotTier{Bytes: uint64(cs.HotBytes), Budget: uint64(cs.HotBudget), Shards: uint32(cs.HotShards)}
	if d.cfg.Storage != nil {
		if err := d.cfg.Storage(ctx); err != nil {
			st.StorageReady, st.StorageError = false, err.Error()
		}
	}
	if d.cfg.BackendErrors != nil { // after the probe, which may have failed just now
		st.BackendErrors = d.cfg.BackendErrors()
	}
	for _, s := range cs.Saves {
		st.Saves = append(st.Saves, &pb.SaveActivity{Target: toTarget(s.Target), State: s.State.String(),
			SecondsInState: now.Sub(s.Since).Seconds(), AgeSeconds: now.Sub(s.Begun).Seconds(), Error: s.Err})
	}
	for _, l := range cs.Leases {
		ls := &pb.LeaseState{IdPrefix: l.ID, Kind: l.Kind, Peer: l.Peer, Bytes: uint64(l.Bytes),
			AgeSeconds: now.Sub(l.Begun).Seconds(), Journaled: l.Journaled}
		if !l.Expires.IsZero() {
			ls.ExpiresInSeconds = max(0, l.Expires.Sub(now).Seconds())
		}
		if l.Kind == "save" {
			ls.Target = toTarget(l.Target)
		}
		st.Leases = append(st.Leases, ls)
	}
	for _, s := range ps.Sessions {
		st.Datasets = append(st.Datasets, &pb.DatasetState{Peer: s.Peer, Source: s.Source, Rank: int32(s.Rank),
			WorldSize: int32(s.WorldSize), Epoch: s.Epoch, IdleSeconds: now.Sub(s.LastUsed).Seconds(),
			Stats: toPrefetchStats(s.Stats), RingSlots: int32(s.RingSlots), RingSlotsMax: int32(s.RingMax),
			ReadAheadBytes: s.ReadAhead, ReadAheadTarget: s.ReadAheadTarget})
	}
	return st, nil
}

// peerName names a connection's client for people: its uid and pid.
func peerName(info *peercred.Info) string {
	return fmt.Sprintf("uid %d pid %d", info.UID, info.PID)
}
