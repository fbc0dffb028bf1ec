package tiers

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ckptd/ckptd/checkpoint"
)

// Source is where a restore reads a shard from: this sidecar's hot tier,
// a peer's replica, or storage. Release it once its bytes are copied out.
type Source struct {
	M *checkpoint.Manifest
	// Tier is where the bytes come from: "hot" (this node's memory),
	// "peer" (another sidecar's replica) or "storage".
	Tier string
	// Skipped, for latest, is a newer step kept in memory only whose ranks
	// are no longer all held anywhere, passed over; 0 when none.
	Skipped int64

	data []byte // the hot copy
	hash string // of M as its holder stores it (hot or peer): what commit records pin
	// fetch reads the shard from a peer; holders are the peers to read it
	// from, in turn, until one gives bytes that verify.
	fetch   func(ctx context.Context, peer string, dst []byte, progress func(int64)) error
	holders []string
	log     func(msg string, args ...any)
	release func()
}

// StorageSource reads the shard m describes from storage.
func StorageSource(m *checkpoint.Manifest) Source {
	return Source{M: m, Tier: "storage"}
}

func hotSource(e *hotEntry, release func()) Source {
	return Source{M: e.m, Tier: "hot", data: e.data, hash: e.hash, release: release}
}

// Release unpins the hot copy, or lets the next fetch from peers begin.
func (s Source) Release() {
	if s.release != nil {
		s.release()
	}
}

// Hot returns the hot copy's bytes when the source is this sidecar's hot
// tier, for a restore that may hand them out as they are (TakePin).
func (s Source) Hot() []byte {
	if s.Tier != "hot" {
		return nil
	}
	return s.data
}

// TakePin takes over the pin that keeps the source's bytes (the hot
// copy's) for the caller, who calls unpin once no one reads them any
// more; Release then does nothing.
func (s *Source) TakePin() (unpin func()) {
	unpin, s.release = s.release, nil
	if unpin == nil {
		unpin = func() {}
	}
	return unpin
}

// PinnedBy reports whether the commit record names this very manifest for
// rank (records before attempts pin none): a copy held in memory, a
// peer's above all, is served only when it is exactly what the step
// committed.
func (s Source) PinnedBy(rec *checkpoint.CommitRecord, rank int) bool {
	return rec.Pins(rank, s.hash)
}

// Fill writes the selected bytes into dst, verified against their chunk
// hashes; store and opts are for a storage source.
func (s Source) Fill(ctx context.Context, store *checkpoint.Store, sel checkpoint.Selection, dst []byte, opts checkpoint.ReadOptions) error {
	switch {
	case s.fetch != nil && sel.Whole:
		return s.eachHolder(func(peer string) error { return s.fetchVerified(ctx, peer, dst) })
	case s.fetch != nil:
		data := make([]byte, s.M.DataSize)
		return s.eachHolder(func(peer string) error {
			if err := s.fetch(ctx, peer, data, func(int64) {}); err != nil {
				return err
			}
			return s.M.CopySelected(data, sel, dst, "replica from a peer")
		})
	case s.data == nil:
		return store.ReadSelected(ctx, s.M, sel, dst, opts)
	case sel.Whole:
		return s.M.CopyVerified(s.data, dst, "hot copy")
	default:
		return s.M.CopySelected(s.data, sel, dst, "hot copy")
	}
}

// fetchVerified reads a peer's replica into dst, checking each chunk
// against its hash as soon as it has arrived, on a goroutine of its own:
// the check overlaps the transfer.
func (s Source) fetchVerified(ctx context.Context, peer string, dst []byte) error {
	m := s.M
	if int64(len(dst)) < m.DataSize {
		return fmt.Errorf("%w: a region of %d bytes for %d", checkpoint.ErrCorrupt, len(dst), m.DataSize)
	}
	arrived := make(chan int64, 64)
	checked := make(chan error, 1)
	go func() { checked <- m.VerifyArriving(dst, arrived, "replica from a peer") }()
	err := s.fetch(ctx, peer, dst[:m.DataSize], func(n int64) { arrived <- n })
	close(arrived)
	return errors.Join(err, <-checked)
}

// eachHolder runs read with each holder of the shard in turn until one
// succeeds: a copy that fails to verify, or a peer that fails, falls back
// to the next holder before the restore fails. It returns the errors of
// all when none succeeds.
func (s Source) eachHolder(read func(peer string) error) error {
	var errs []error
	for i, peer := range s.holders {
		err := read(peer)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("peer %s: %w", peer, err))
		if i+1 < len(s.holders) && s.log != nil {
			s.log("a peer's copy failed; reading the next holder's", "peer", peer, "target", s.M.Target(), "err", err)
		}
	}
	return errors.Join(errs...)
}

// Hot pins the hot tier's committed copy of rank's shard of step (by
// attempt, when not empty).
func (t *Tiers) Hot(job string, step int64, rank int, attempt string) (Source, bool) {
	if e, release := t.hot.get(job, step, rank, attempt); e != nil {
		return hotSource(e, release), true
	}
	return Source{}, false
}

// CommittedCopy is a copy, here or at a peer, of rank's shard of a step
// committed by whichever attempt the copy's holder knows of.
func (t *Tiers) CommittedCopy(ctx context.Context, job string, step int64, rank int) (Source, bool) {
	if src, ok := t.Hot(job, step, rank, ""); ok {
		return src, true
	}
	return t.FromPeers(ctx, job, step, rank, "", nil)
}

// FromPeers finds a shard at the peers that keep its rank's replicas (or
// those in from), if there are any and one has it: a node's trainer
// restarted on another node reads no storage data. Only the manifest is
// read here; Fill reads the data straight into the restore's region,
// verifying each chunk as it arrives.
func (t *Tiers) FromPeers(ctx context.Context, job string, step int64, rank int, attempt string, from []string) (Source, bool) {
	if t.cfg.Peers == nil {
		return Source{}, false
	}
	if len(from) == 0 {
		from = t.cfg.Peers.Candidates(rank)
	}
	select { // one shard from peers at a time (a partial restore buffers it: --hot-bytes at most, see the memory ceiling)
	case t.fetching <- struct{}{}:
	case <-ctx.Done():
		return Source{}, false
	}
	done := func() { <-t.fetching }
	m, peer, err := t.cfg.Peers.FetchManifest(ctx, job, step, rank, attempt, from)
	switch {
	case err != nil:
		done()
		t.log.Debug("no replica from peers", "job", job, "step", step, "rank", rank, "err", err)
		return Source{}, false
	case m.Job != job || m.Step != step || m.Rank != rank || attempt != "" && m.Attempt != attempt:
		done()
		t.log.Warn("a peer answered with another shard; ignored", "want_step", step, "want_rank", rank, "got", m.Target())
		return Source{}, false
	case m.DataSize > t.cfg.HotBytes:
		done()
		t.log.Warn("a peer's replica is larger than this sidecar's hot tier; ignored", "target", m.Target(), "bytes", m.DataSize)
		return Source{}, false
	}
	t.log.Info("restoring from a peer's replica", "target", m.Target(), "peer", peer)
	fetch := func(ctx context.Context, peer string, dst []byte, progress func(int64)) error {
		return t.cfg.Peers.FetchData(ctx, peer, m, dst, progress) // it fails unless peer holds m exactly
	}
	// The peers asked after the one that answered hold it too, or answer
	// that they do not.
	holders := []string{peer}
	if i := slices.Index(from, peer); i >= 0 {
		holders = append(holders, from[i+1:]...)
	}
	return Source{M: m, Tier: "peer", hash: m.Hash(), fetch: fetch, holders: holders, log: t.log.Warn, release: done}, true
}
