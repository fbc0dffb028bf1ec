package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/storage"
)

// A step of more than groupRanks ranks commits from summaries of its
// groups of ranks rather than from every manifest: the rank whose
// manifest completes a group of groupRanks (the one whose listing of the
// group finds it whole, or the few racing it) reads the group's manifests
// and writes what they add to the commit record as the group's summary,
// <attempt>/group-<first rank, 5 digits>.json; then it lists the
// attempt's summaries, and the one that finds them all commits the step
// from them. Each writes before it lists, so the last to write sees every
// summary. The rank completing a step of N ranks thus reads at most
// groupRanks manifests and N/groupRanks summaries, where it read N
// manifests: the time from the last manifest to COMMIT.json no longer
// grows with N (up to a listing's page of summaries, 100,000 ranks).
//
// A group whose completing rank died before writing its summary leaves
// the step to the waiters' fallback (PollCommit), which reads every
// manifest as before.

// groupRanks is the ranks of a group: the smallest of rankGroups, whose
// manifests one listing page holds.
var groupRanks = rankGroups[0]

const (
	// GroupFormat is the format of a group summary.
	GroupFormat  = "ckptd.group"
	GroupVersion = 1
	// maxGroupBytes bounds a group summary as read: groupRanks manifest
	// references of ~150 bytes.
	maxGroupBytes = 64 << 10
	groupPrefix   = "group-"
)

// groupSummary is what the manifests of ranks [FirstRank, FirstRank +
// len(Manifests)) of an attempt add to its step's commit record.
type groupSummary struct {
	Format           string        `json:"format"`
	Version          int           `json:"version"`
	Job              string        `json:"job"`
	Step             int64         `json:"step"`
	Attempt          string        `json:"attempt"`
	WorldSize        int           `json:"world_size"`
	FirstRank        int           `json:"first_rank"`
	Manifests        []ManifestRef `json:"manifests"`
	Bytes            int64         `json:"bytes"`
	StoredBytes      int64         `json:"stored_bytes"`
	NonFinite        int64         `json:"nonfinite,omitempty"`
	NonFiniteTensors int           `json:"nonfinite_tensors,omitempty"`
}

// groupObject is the summary of the group starting at first, relative
// to the job folder.
func groupObject(step int64, attempt string, first int) string {
	return fmt.Sprintf("%s%s%05d.json", attemptDir(step, attempt), groupPrefix, first)
}

// groupOf returns the first and end rank of rank's group in a step of
// worldSize ranks.
func groupOf(rank, worldSize int) (first, end int) {
	first = rank / groupRanks.size * groupRanks.size
	return first, min(first+groupRanks.size, worldSize)
}

// commitByGroups is TryCommitRank for a step of more than groupRanks
// ranks (see above).
func (s *Store) commitByGroups(ctx context.Context, t Target) (*CommitRecord, bool, error) {
	first, end := groupOf(t.Rank, t.WorldSize)
	dir := inJob(s.job, attemptDir(t.Step, t.Attempt))
	names, err := s.manifestsUnder(ctx, dir+"rank-"+fmt.Sprintf("%05d", first)[:groupRanks.digits])
	if err != nil || ranksIn(names, first, end) < end-first {
		return nil, false, err
	}
	if err := s.writeGroup(ctx, t, first, end, names); err != nil {
		return nil, false, err
	}
	firsts, err := s.groupsWritten(ctx, t)
	if err != nil || len(firsts) < (t.WorldSize+groupRanks.size-1)/groupRanks.size {
		return nil, false, err
	}
	if rec, err := s.ReadCommit(ctx, t.Step); !errors.Is(err, storage.ErrNotFound) {
		s.notePoll(t.Step, rec)
		return rec, false, err
	}
	rec, err := s.recordFromGroups(ctx, t, firsts)
	if err != nil {
		return nil, false, err
	}
	return s.writeCommit(ctx, t, rec)
}

// writeGroup reads the manifests of ranks [first, end) of t's attempt
// (names lists them, among others) and writes their group's summary. A
// summary already there (a rank racing this one wrote it) is left.
func (s *Store) writeGroup(ctx context.Context, t Target, first, end int, names []string) error {
	var mine []string
	for _, name := range names {
		if r, ok := rankOfManifest(name); ok && r >= first && r < end {
			mine = append(mine, name)
		}
	}
	tt := t
	tt.Rank = 0
	rec, err := s.summarize(ctx, tt, mine)
	if err != nil {
		return err
	}
	g := groupSummary{Format: GroupFormat, Version: GroupVersion, Job: t.Job, Step: t.Step, Attempt: t.Attempt,
		WorldSize: t.WorldSize, FirstRank: first, Manifests: rec.Manifests[first:end], Bytes: rec.Bytes,
		StoredBytes: rec.StoredBytes, NonFinite: rec.NonFinite, NonFiniteTensors: rec.NonFiniteTensors}
	data, err := json.Marshal(g)
	if err != nil {
		return err
	}
	err = s.backend.PutIfAbsent(ctx, inJob(s.job, groupObject(t.Step, t.Attempt, first)), data)
	if err != nil && !errors.Is(err, storage.ErrExists) {
		return fmt.Errorf("write the summary of ranks %d-%d of step %d: %w", first, end-1, t.Step, err)
	}
	return nil
}

// groupsWritten lists the first ranks of the groups of t's attempt whose
// summaries are written.
func (s *Store) groupsWritten(ctx context.Context, t Target) ([]int, error) {
	prefix := inJob(s.job, attemptDir(t.Step, t.Attempt)) + groupPrefix
	var firsts []int
	err := s.backend.List(ctx, prefix, func(oi storage.ObjectInfo) error {
		digits, ok := strings.CutSuffix(strings.TrimPrefix(oi.Name, prefix), ".json")
		first, err := strconv.Atoi(digits)
		if ok && err == nil && len(digits) == 5 && first%groupRanks.size == 0 && first < t.WorldSize {
			firsts = append(firsts, first)
		}
		return nil
	})
	return firsts, err
}

// recordFromGroups builds t's commit record from the summaries of the
// groups starting at firsts (every group of the step, each once).
func (s *Store) recordFromGroups(ctx context.Context, t Target, firsts []int) (*CommitRecord, error) {
	rec := newRecord(t)
	names := make([]string, len(firsts))
	firstOf := make(map[string]int, len(firsts))
	for i, first := range firsts {
		names[i] = inJob(s.job, groupObject(t.Step, t.Attempt, first))
		firstOf[names[i]] = first
	}
	err := s.readEach(ctx, names, maxGroupBytes, func(name string, data []byte) (func() error, error) {
		sum, err := parseGroup(data, t, firstOf[name])
		return func() error { return rec.addGroup(sum) }, err
	})
	if err != nil {
		return nil, err
	}
	return rec, nil
}

// addGroup counts a group's summary in the record.
func (rec *CommitRecord) addGroup(g *groupSummary) error {
	var ok [4]bool
	var tensors int64
	rec.Bytes, ok[0] = addInt64(rec.Bytes, g.Bytes)
	rec.StoredBytes, ok[1] = addInt64(rec.StoredBytes, g.StoredBytes)
	rec.NonFinite, ok[2] = addInt64(rec.NonFinite, g.NonFinite)
	tensors, ok[3] = addInt64(int64(rec.NonFiniteTensors), int64(g.NonFiniteTensors))
	if ok != [4]bool{true, true, true, true} || tensors > int64(^uint(0)>>1) {
		return fmt.Errorf("%w: the counts of step %d's groups overflow", ErrCorrupt, rec.Step)
	}
	rec.NonFiniteTensors = int(tensors)
	copy(rec.Manifests[g.FirstRank:], g.Manifests)
	return nil
}

// parseGroup decodes the summary of the group of t's attempt that starts
// at first, and checks that it is one: of t's step, attempt and world
// size, of exactly the group's ranks, each manifest named canonically
// with a hash, and no negative count.
func parseGroup(b []byte, t Target, first int) (*groupSummary, error) {
	if len(b) > maxGroupBytes {
		return nil, fmt.Errorf("%w: a group summary of %d bytes, more than %d", ErrCorrupt, len(b), maxGroupBytes)
	}
	var g groupSummary
	if err := json.Unmarshal(b, &g); err != nil {
		return nil, fmt.Errorf("%w: a group summary that is not valid JSON: %v", ErrCorrupt, err)
	}
	if err := checkFormat(g.Format, g.Version, GroupFormat, 1, GroupVersion); err != nil {
		return nil, err
	}
	_, end := groupOf(first, t.WorldSize)
	switch {
	case g.Job != t.Job || g.Step != t.Step || g.Attempt != t.Attempt || g.WorldSize != t.WorldSize:
		return nil, fmt.Errorf("%w: the summary describes job %q step %d attempt %q of %d ranks", ErrCorrupt, g.Job, g.Step, g.Attempt, g.WorldSize)
	case g.FirstRank != first || len(g.Manifests) != end-first:
		return nil, fmt.Errorf("%w: the summary lists %d ranks from %d, not ranks %d-%d", ErrCorrupt, len(g.Manifests), g.FirstRank, first, end-1)
	case g.Bytes < 0 || g.StoredBytes < 0 || g.NonFinite < 0 || g.NonFiniteTensors < 0:
		return nil, fmt.Errorf("%w: negative counts in a group summary", ErrCorrupt)
	}
	for i, ref := range g.Manifests {
		if want := (Target{Step: t.Step, Attempt: t.Attempt, Rank: first + i}).manifestObject(); ref.Object != want {
			return nil, fmt.Errorf("%w: rank %d's manifest is %q, want %q", ErrCorrupt, first+i, ref.Object, want)
		}
		if _, err := codec.ParseHash(ref.Hash); err != nil {
			return nil, fmt.Errorf("%w: rank %d's manifest hash: %v", ErrCorrupt, first+i, err)
		}
	}
	return &g, nil
}
