package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// rankGroups are the groups of ranks a rank's commit check climbs
// through, smallest first. Ranks have 5 digits in object names, so the
// 10^k ranks that share their first 5-k digits share a name prefix, and
// one listing of that prefix holds all their objects: 200 names (one
// page of an S3 listing) for a group of 100 ranks.
var rankGroups = [...]struct{ size, digits int }{{100, 3}, {1000, 2}, {10000, 1}, {100000, 0}}

// TryCommitRank is TryCommit as the drain of t's rank makes it, right
// after writing t's manifest: it commits t's step when all world_size
// manifests of t's attempt are there, and returns the same as TryCommit.
//
// Unlike TryCommit it does not list the whole attempt: it lists the group
// of 100 ranks around t.Rank. Whichever rank's manifest completes a group
// is followed by a listing that sees the group whole (storage lists what
// was written before): in a step of up to 100 ranks that rank reads the
// manifests and commits; in a larger one it writes the group's summary
// and commits once every group's is there (group.go). Still no
// coordinator, and each rank makes one listing of one page, where a
// listing of the whole attempt costs a page per 500 ranks. Only the few
// ranks that complete a group list and read more.
//
// It does not read the commit record until the step looks whole: a save
// whose step another attempt committed is told so when it waits (see
// PollCommit), or when it climbs to the top.
func (s *Store) TryCommitRank(ctx context.Context, t Target) (rec *CommitRecord, won bool, err error) {
	if err := t.Validate(); err != nil {
		return nil, false, err
	}
	if t.WorldSize > groupRanks.size {
		return s.commitByGroups(ctx, t)
	}
	names, err := s.wholeAround(ctx, t)
	if err != nil || names == nil {
		return nil, false, err
	}
	return s.commitWhole(ctx, t, names)
}

// commitWhole commits t's step, whose manifests names are all there,
// unless another rank completing it at the same time did already: one
// read saves reading every manifest.
func (s *Store) commitWhole(ctx context.Context, t Target, names []string) (*CommitRecord, bool, error) {
	if rec, err := s.ReadCommit(ctx, t.Step); !errors.Is(err, storage.ErrNotFound) {
		s.notePoll(t.Step, rec)
		return rec, false, err
	}
	return s.commitFrom(ctx, t, names)
}

// wholeAround lists the groups of ranks around t.Rank (rankGroups),
// smallest first, and returns every manifest of t's attempt once all its
// world_size ranks have one; nil while the group it reached lacks one.
// (The waiters' fallback climbs so at any size: it needs no summary.)
func (s *Store) wholeAround(ctx context.Context, t Target) ([]string, error) {
	dir := inJob(s.job, attemptDir(t.Step, t.Attempt))
	for _, g := range rankGroups {
		lo := t.Rank / g.size * g.size
		hi := min(lo+g.size, t.WorldSize)
		names, err := s.manifestsUnder(ctx, dir+"rank-"+fmt.Sprintf("%05d", lo)[:g.digits])
		if err != nil {
			return nil, err
		}
		if ranksIn(names, lo, hi) < hi-lo {
			return nil, nil
		}
		if lo == 0 && hi == t.WorldSize {
			return names, nil
		}
	}
	return nil, fmt.Errorf("%w: rank %d of world size %d has no group", ErrInvalid, t.Rank, t.WorldSize)
}

// ranksIn counts the ranks in [lo, hi) that names (manifests of one
// attempt, each once) hold. A name that is not a rank's manifest counts
// for none; summarize refuses it when the step looks whole.
func ranksIn(names []string, lo, hi int) int {
	n := 0
	for _, name := range names {
		if r, ok := rankOfManifest(name); ok && r >= lo && r < hi {
			n++
		}
	}
	return n
}

// rankOfManifest is the rank whose manifest name is, if it is one.
func rankOfManifest(name string) (int, bool) {
	digits, ok := strings.CutPrefix(path.Base(name), "rank-")
	if !ok {
		return 0, false
	}
	r, err := strconv.Atoi(strings.TrimSuffix(digits, manifestSuffix))
	return r, err == nil
}

// PollCommit is a waiting rank's look at its step: the step's commit
// record when it has one (by any attempt: the caller compares), else nil;
// and, rarely, TryCommitRank on its behalf (won says whether that wrote
// the record).
//
// The waiters of one step in this process share their looks: one reads
// the commit record while the others wait for its answer, and an answer
// younger than pollShare(world size) is given again without asking
// storage, so a node's waiters ask about once per pollShare whatever
// their number, and a commit this process made or saw is known to all
// its waiters at once.
//
// Waiting ranks normally commit nothing: the drain of the step's last rank
// does (TryCommitRank), and retries until it succeeds. If that drain
// stops for good (its node lost with its journal), nobody else would ever
// commit the step, so waiters check for that: from fallbackStart after
// this process's first look, at most once per fallbackSpread (at random
// moments), one of them climbs the groups as TryCommitRank does, and
// commits the step once it has found it whole for fallbackGrace without a
// commit record. A healthy commit, even one slowed by throttling, is not
// raced by the waiters of every node reading every manifest again.
func (s *Store) PollCommit(ctx context.Context, t Target) (rec *CommitRecord, won bool, err error) {
	if err := t.Validate(); err != nil {
		return nil, false, err
	}
	p := s.poll(t)
	if p == nil { // a backend that cannot key the table: every look is a full one
		if rec, err := s.ReadCommit(ctx, t.Step); !errors.Is(err, storage.ErrNotFound) {
			return rec, false, err
		}
		return s.TryCommitRank(ctx, t)
	}
	if rec := p.seen(t.WorldSize); rec != nil {
		return rec, false, nil
	}
	select {
	case p.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
	check, err := p.look(ctx, s, t)
	<-p.turn // the other waiters need not wait for this one's check
	if err != nil || !check {
		return p.seen(t.WorldSize), false, err
	}
	names, err := s.wholeAround(ctx, t)
	if err != nil || names == nil || !p.wholeFor(fallbackGrace(t.WorldSize)) {
		return nil, false, err
	}
	return s.commitWhole(ctx, t, names)
}

// look is a waiter's look, holding the turn: it refreshes what the
// process knows of the commit record, and reports whether this waiter is
// to check whether the step is stuck.
func (p *commitPoll) look(ctx context.Context, s *Store, t Target) (check bool, err error) {
	now := time.Now()
	if err := p.refresh(ctx, s, t); err != nil || p.seen(t.WorldSize) != nil || now.Before(p.checkAt) {
		return false, err
	}
	p.checkAt = now.Add(randomIn(fallbackSpread(t.WorldSize)))
	return true, nil
}

// refresh reads the step's commit record, holding the turn, unless a
// look younger than pollShare found it, or found none.
func (p *commitPoll) refresh(ctx context.Context, s *Store, t Target) error {
	if p.seen(t.WorldSize) != nil || time.Since(p.readAt) < pollShare(t.WorldSize) {
		return nil
	}
	rec, err := s.ReadCommit(ctx, t.Step)
	switch {
	case err == nil:
		p.note(rec)
	case errors.Is(err, storage.ErrNotFound):
		p.readAt = time.Now()
	default:
		return err
	}
	return nil
}

// ReadCommitShared is ReadCommit of t's step through the table the
// step's waiters in this process share (see PollCommit): a look younger
// than pollShare answers for storage. A drain about to write t's rank
// asks it whether the step is committed: the ranks of a node, saving the
// same step at once, then ask storage about once, where a commit record
// every rank of a large job asks for at the same moment would be
// throttled. What it answers is as old as pollShare at most, as a read is
// by the time its answer is acted on.
func (s *Store) ReadCommitShared(ctx context.Context, t Target) (*CommitRecord, error) {
	p := s.poll(t)
	if p == nil {
		return s.ReadCommit(ctx, t.Step)
	}
	if rec := p.seen(t.WorldSize); rec != nil {
		return rec, nil
	}
	select {
	case p.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	err := p.refresh(ctx, s, t)
	<-p.turn
	if err != nil {
		return nil, err
	}
	if rec := p.seen(t.WorldSize); rec != nil {
		return rec, nil
	}
	return nil, fmt.Errorf("%s: %w", commitName(s.job, t.Step), storage.ErrNotFound)
}

// wholeFor reports whether this process has found the step whole, and
// uncommitted, for at least d, counting from now if it never had.
func (p *commitPoll) wholeFor(d time.Duration) bool {
	now := time.Now().UnixNano()
	p.wholeSince.CompareAndSwap(0, now)
	return time.Duration(now-p.wholeSince.Load()) >= d
}

// pollShare is how long a look at a step's commit record is shared by its
// waiters in a process: a quarter of a millisecond per rank, between 250
// ms and 2 s. A step of 16,384 ranks on 2,048 nodes is then asked about
// 1,000 times a second, within what S3 serves on one prefix (5,500 reads a
// second), where every rank asking every 250 ms would be 65,000.
func pollShare(worldSize int) time.Duration {
	return min(max(time.Duration(worldSize)*250*time.Microsecond, 250*time.Millisecond), 2*time.Second)
}

// fallbackStart is how long after a process's first look at a step its
// waiters start checking whether the step is stuck: longer than a step
// of a healthy job takes to commit once its ranks are written.
var fallbackStart = func(worldSize int) time.Duration {
	return 10*time.Second + time.Duration(worldSize)*time.Millisecond
}

// fallbackSpread is the window over which a process spreads its checks,
// one per window (10 ms per rank, at least 5 s): with 8 ranks per node
// the nodes of a job check about 12 times a second in all, whatever its
// size. A check lists a page, more when the step is whole.
var fallbackSpread = func(worldSize int) time.Duration {
	return max(5*time.Second, time.Duration(worldSize)*10*time.Millisecond)
}

// fallbackGrace is how long a step must have been found whole without a
// commit record before a waiter commits it: far longer than its last
// rank's drain takes to read every manifest and commit, even throttled (30
// s, plus 10 ms per rank).
var fallbackGrace = func(worldSize int) time.Duration {
	return 30*time.Second + time.Duration(worldSize)*10*time.Millisecond
}

func randomIn(d time.Duration) time.Duration { return rand.N(d) }

// commitPoll is what the waiters of one step in this process share.
type commitPoll struct {
	rec atomic.Pointer[seenRecord] // the step's commit record, once seen
	// turn is held by the waiter looking (the others wait for its
	// answer); it guards readAt and checkAt.
	turn       chan struct{}
	readAt     time.Time    // of the last look that found no record
	checkAt    time.Time    // when a look next checks whether the step is stuck
	wholeSince atomic.Int64 // when a check first found it whole (UnixNano; 0: never)
	used       time.Time    // guarded by commitPolls' lock
}

// seenRecord is a commit record and when it was seen. It is given to
// waiters for pollShare only, as a look that found none is: a step can be
// deleted, and saved again.
type seenRecord struct {
	rec *CommitRecord
	at  time.Time
}

func (p *commitPoll) note(rec *CommitRecord) {
	p.rec.Store(&seenRecord{rec: rec, at: time.Now()})
}

// seen returns the commit record seen within pollShare, or nil.
func (p *commitPoll) seen(worldSize int) *CommitRecord {
	if sr := p.rec.Load(); sr != nil && time.Since(sr.at) < pollShare(worldSize) {
		return sr.rec
	}
	return nil
}

type pollKey struct {
	b    storage.Backend
	job  string
	step int64
}

// commitPolls holds the steps being waited for in this process, by
// backend: a process-wide table, because Stores are made per request.
// Entries unused for pollIdle are dropped.
var commitPolls = struct {
	sync.Mutex
	m     map[pollKey]*commitPoll
	swept time.Time
}{m: map[pollKey]*commitPoll{}}

const pollIdle = time.Minute

// poll returns t's step's shared entry, making it; nil when the backend
// cannot be a map key.
func (s *Store) poll(t Target) *commitPoll {
	if !reflect.TypeOf(s.backend).Comparable() {
		return nil
	}
	now := time.Now()
	commitPolls.Lock()
	defer commitPolls.Unlock()
	if now.Sub(commitPolls.swept) > pollIdle/4 {
		for k, p := range commitPolls.m {
			if now.Sub(p.used) > pollIdle {
				delete(commitPolls.m, k)
			}
		}
		commitPolls.swept = now
	}
	k := pollKey{s.backend, s.job, t.Step}
	p := commitPolls.m[k]
	if p == nil {
		p = &commitPoll{turn: make(chan struct{}, 1),
			checkAt: now.Add(fallbackStart(t.WorldSize) + randomIn(fallbackSpread(t.WorldSize)))}
		commitPolls.m[k] = p
	}
	p.used = now
	return p
}

// notePoll tells step's waiters in this process, if any, its commit
// record (nil: nothing to tell).
func (s *Store) notePoll(step int64, rec *CommitRecord) {
	if rec == nil || !reflect.TypeOf(s.backend).Comparable() {
		return
	}
	commitPolls.Lock()
	p := commitPolls.m[pollKey{s.backend, s.job, step}]
	commitPolls.Unlock()
	if p != nil {
		p.note(rec)
	}
}
