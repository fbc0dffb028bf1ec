package checkpoint

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/ckptd/ckptd/storage"
)

// TemporaryInfo is what a writer of one of the job's objects left in the
// store mid-write (a POSIX temporary file, an S3 multipart upload): a
// write in progress, or one whose writer died. Step and Attempt come from
// the name of the object it would become; Step is -1 for a name outside
// the steps' folders.
type TemporaryInfo struct {
	storage.Temporary
	Step    int64
	Attempt string
}

// Temporaries lists every temporary under the job's steps, oldest write
// first. A write in progress shows too: only its age (ModTime) tells a
// dead writer's from a live one's.
func (s *Store) Temporaries(ctx context.Context) ([]TemporaryInfo, error) {
	return s.temporaries(ctx, stepsPrefix(s.job))
}

func (s *Store) temporaries(ctx context.Context, prefix string) ([]TemporaryInfo, error) {
	var out []TemporaryInfo
	err := s.backend.ListTemporaries(ctx, prefix, func(t storage.Temporary) error {
		step, attempt := s.placeOf(t.Name)
		out = append(out, TemporaryInfo{Temporary: t, Step: step, Attempt: attempt})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list temporaries of %s: %w", prefix, err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ModTime.Before(out[j].ModTime) })
	return out, nil
}

// placeOf reads the step and attempt from an object name of the job
// ("job/steps/<12 digits>/<attempt>/...", or a spread data object's
// "job/steps/spread-<hh>/<12 digits>/<attempt>/..."); -1 when it is not
// one.
func (s *Store) placeOf(name string) (int64, string) {
	rest, ok := strings.CutPrefix(name, stepsPrefix(s.job))
	if !ok {
		return -1, ""
	}
	if spread, ok := strings.CutPrefix(rest, spreadPrefix); ok {
		hh, after, found := strings.Cut(spread, "/")
		if !found || len(hh) != 2 || strings.Trim(hh, "0123456789abcdef") != "" || strings.Count(after, "/") < 2 {
			return -1, "" // a spread data object is always in an attempt's folder
		}
		rest = after
	}
	seg, rest, _ := strings.Cut(rest, "/")
	step, ok := parseStepSegment(seg)
	if !ok {
		return -1, ""
	}
	attempt, _, found := strings.Cut(rest, "/")
	if !found {
		attempt = "" // a format-1 object, in the step folder itself
	}
	return step, attempt
}

// RemoveRankTemporaries deletes what earlier writes of t's objects left
// mid-write, best effort. Only the save of t writes under its names, so
// when that save is replayed from the journal after a crash, whatever is
// there is the dead process's and can go at once, without waiting for
// prune's grace.
func (s *Store) RemoveRankTemporaries(ctx context.Context, t Target) {
	var temps []TemporaryInfo
	for _, prefix := range []string{inJob(t.Job, attemptDir(t.Step, t.Attempt)) + fmt.Sprintf("rank-%05d.", t.Rank),
		inJob(t.Job, strings.TrimSuffix(t.spreadDataObject(), "data"))} {
		more, err := s.temporaries(ctx, prefix)
		if err != nil {
			s.log().Warn("could not list what an earlier write of a replayed save left; prune removes it", "target", t, "err", err)
			return
		}
		temps = append(temps, more...)
	}
	for _, tmp := range temps {
		if err := s.backend.DeleteTemporary(ctx, tmp.Temporary); err != nil {
			s.log().Warn("could not remove what an earlier write of a replayed save left; prune removes it", "target", t, "temporary", tmp.ID, "err", err)
			continue
		}
		s.log().Info("removed what an earlier write of a replayed save left", "target", t, "temporary", tmp.ID, "bytes", tmp.Size)
	}
}
