package checkpoint

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Incremental saves (WriterOptions.Incremental) reference the chunks of
// the job's newest committed step whose content they repeat instead of
// writing them again; see doc.go for the format and the protocol below
// for why prune can never take what such a save relies on.
//
// A drain that references a committed step B (its "base") first writes a
// pin, pins/<B>/<step>-<attempt>-<rank>, then checks that no prune is
// running (no live marker under prune/) and that B is still committed;
// only then does it read B's manifest and reference its chunks. Prune and
// DeleteStep write their marker first, then list the pins, then read the
// commit records: a base pinned before a prune's listing is kept whole,
// and a drain that pinned after it sees the prune's marker (or, if that
// prune has finished, B's commit record gone) and writes every chunk.
// The pin goes once the save's step is committed, whose manifest then
// keeps what it references; a pin older than prune's grace is taken for a
// dead daemon's and removed. A prune stops deleting pruneWindow after its
// marker (the marker's life is twice that, room for clock skew between
// the nodes and the store).
const (
	pinsDir         = "pins/"
	pruneMarkersDir = "prune/"
	pruneWindow     = 30 * time.Minute
	markerLife      = 2 * pruneWindow
)

// ErrPinned: a step is the base of an incremental save in flight, which
// relies on its chunks until the save's step commits.
var ErrPinned = errors.New("step is the base of an incremental save in flight")

// ErrPruneWindow: a prune ran past pruneWindow and stopped deleting, so
// that an incremental save starting now cannot miss it. Running it again
// continues where it stopped.
var ErrPruneWindow = errors.New("prune ran past its deletion window")

// Owns reports whether c is stored in the manifest's own data object, not
// referenced in an earlier step's by an incremental save.
func (m *Manifest) Owns(c Chunk) bool {
	return c.Object == m.Target().dataObject() || c.Object == m.Target().spreadDataObject()
}

// pinName is the pin of t's save on base, in the store.
func pinName(base int64, t Target) string {
	return inJob(t.Job, fmt.Sprintf("%s%s/%s-%s-%05d", pinsDir, stepSegment(base), stepSegment(t.Step), t.Attempt, t.Rank))
}

// dedupBase is what an incremental save may reference: the chunks of its
// rank in the base step, by content key.
type dedupBase struct {
	step   int64
	chunks map[string]Chunk
}

// lookup returns the base's chunk holding exactly c's raw bytes (same key,
// length and hash), placed at c's offset in data space.
func (b *dedupBase) lookup(c Chunk) (Chunk, bool) {
	if b == nil {
		return Chunk{}, false
	}
	found, ok := b.chunks[c.Key]
	if !ok || found.Raw != c.Raw || found.Hash != c.Hash {
		return Chunk{}, false
	}
	found.RawOffset = c.RawOffset
	return found, true
}

// pins remembers the pins this Writer wrote, by save (a Target without
// its world size), so that Unpin needs no listing. A daemon that dies
// leaves its pins to prune's grace.
type pins struct {
	mu    sync.Mutex
	names map[Target]string
}

func pinKey(t Target) Target {
	t.WorldSize = 0
	return t
}

func (p *pins) set(t Target, name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.names == nil {
		p.names = map[Target]string{}
	}
	p.names[pinKey(t)] = name
}

func (p *pins) take(t Target) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	name := p.names[pinKey(t)]
	delete(p.names, pinKey(t))
	return name
}

// older returns the saves of t's job and rank with a pin, of steps up to
// step.
func (p *pins) older(t Target, step int64) []Target {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Target
	for k := range p.names {
		if k.Job == t.Job && k.Rank == t.Rank && k.Step <= step && k != pinKey(t) {
			out = append(out, k)
		}
	}
	return out
}

// Unpin removes the pin of t's save, if it wrote one: call it once t's
// step is committed (its manifest keeps what it references from then on)
// or the save has failed for good. Best effort: a pin left behind only
// keeps its base one grace longer.
func (w *Writer) Unpin(ctx context.Context, t Target) {
	if name := w.pins.take(t); name != "" {
		_ = w.b.Delete(ctx, name)
	}
}

// unpinCommitted removes the pins of this rank's earlier saves whose step
// is committed: a daemon does not learn of every commit (a step commits
// on the node of its last rank, and its other ranks hear of it only if
// their trainer waits).
func (w *Writer) unpinCommitted(ctx context.Context, s *Store, t Target, latest int64) {
	for _, old := range w.pins.older(t, latest) {
		if old.Step == latest {
			w.Unpin(ctx, old)
		} else if _, err := s.backend.Stat(ctx, commitName(s.job, old.Step)); err == nil {
			w.Unpin(ctx, old)
		}
	}
}

// dedupBase pins the newest committed step of t's job and returns the
// chunks of t's rank there, or nil when there is nothing to reference
// safely: no committed step, a step of another world size's rank numbering
// that lacks t's rank, a prune running, a base removed meanwhile, or a base
// written without content keys.
func (w *Writer) dedupBase(ctx context.Context, t Target) (*dedupBase, error) {
	s := &Store{backend: w.b, job: t.Job}
	rec, err := s.latest(ctx)
	switch {
	case errors.Is(err, ErrStepNotFound):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("find the base of an incremental save: %w", err)
	case rec.Version < 2 || rec.Step == t.Step || t.Rank >= rec.WorldSize:
		return nil, nil
	}
	pin := pinName(rec.Step, t)
	if err := w.b.Put(ctx, pin, bytes.NewReader(nil), 0); err != nil {
		return nil, fmt.Errorf("pin step %d as the base of an incremental save: %w", rec.Step, err)
	}
	w.pins.set(t, pin)
	w.unpinCommitted(ctx, s, t, rec.Step)
	base, err := s.readBase(ctx, rec, t.Rank)
	if base == nil {
		w.Unpin(ctx, t)
	}
	return base, err
}

// readBase reads rank's chunks in rec's step, once pinned, unless a prune
// is running or has removed the step since.
func (s *Store) readBase(ctx context.Context, rec *CommitRecord, rank int) (*dedupBase, error) {
	busy, err := s.pruneRunning(ctx)
	if err != nil || busy {
		return nil, err
	}
	if _, err := s.backend.Stat(ctx, commitName(s.job, rec.Step)); err != nil {
		if errors.Is(err, storage.ErrNotFound) {
			return nil, nil
		}
		return nil, fmt.Errorf("check the base of an incremental save: %w", err)
	}
	m, err := s.Manifest(ctx, rec, rank)
	switch {
	case errors.Is(err, ErrCorrupt):
		return nil, nil // verify names the damage; this save just writes everything
	case err != nil:
		return nil, fmt.Errorf("read the base of an incremental save: %w", err)
	}
	base := &dedupBase{step: rec.Step, chunks: map[string]Chunk{}}
	for _, c := range m.Chunks {
		if c.Key != "" {
			base.chunks[c.Key] = c
		}
	}
	if len(base.chunks) == 0 {
		return nil, nil
	}
	return base, nil
}

// pruneRunning reports whether a prune or delete has a live marker.
func (s *Store) pruneRunning(ctx context.Context) (bool, error) {
	busy := false
	err := s.backend.List(ctx, inJob(s.job, pruneMarkersDir), func(oi storage.ObjectInfo) error {
		if time.Since(oi.ModTime) < markerLife {
			busy = true
		}
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("look for a running prune: %w", err)
	}
	return busy, nil
}

// announcePrune writes a prune marker, before the pins are read, and
// returns the function that removes it.
func (s *Store) announcePrune(ctx context.Context) (remove func(), err error) {
	id := make([]byte, 8)
	_, _ = rand.Read(id)
	name := inJob(s.job, pruneMarkersDir+hex.EncodeToString(id))
	if err := s.backend.Put(ctx, name, bytes.NewReader(nil), 0); err != nil {
		return nil, fmt.Errorf("announce the prune: %w", err)
	}
	return func() { _ = s.backend.Delete(context.WithoutCancel(ctx), name) }, nil
}

// pinnedSteps lists the bases of incremental saves in flight. Pins idle
// since before cutoff are a dead daemon's: removed (unless dryRun) and
// not counted, as is a stale prune marker.
func (s *Store) pinnedSteps(ctx context.Context, cutoff time.Time, dryRun bool) (map[int64]bool, error) {
	pinned := map[int64]bool{}
	var stale []string
	prefix := inJob(s.job, pinsDir)
	err := s.backend.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		seg, _, found := strings.Cut(strings.TrimPrefix(oi.Name, prefix), "/")
		step, ok := parseStepSegment(seg)
		switch {
		case !found || !ok:
			return nil // not a pin: left alone
		case oi.ModTime.Before(cutoff):
			stale = append(stale, oi.Name)
		default:
			pinned[step] = true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the pins of incremental saves: %w", err)
	}
	err = s.backend.List(ctx, inJob(s.job, pruneMarkersDir), func(oi storage.ObjectInfo) error {
		if time.Since(oi.ModTime) > markerLife {
			stale = append(stale, oi.Name)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list prune markers: %w", err)
	}
	for _, name := range stale {
		if dryRun {
			break
		}
		if err := s.backend.Delete(ctx, name); err != nil {
			return nil, fmt.Errorf("remove a stale pin: %w", err)
		}
	}
	return pinned, nil
}
