package server

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/prefetch"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/s3"
)

// Every core error reaches clients with the right code and reason, and
// the fields they act on.
func TestToStatus(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("outer: %w", err) }
	for _, tc := range []struct {
		err    error
		code   codes.Code
		reason string
		meta   map[string]string
	}{
		{wrap(checkpoint.ErrInvalid), codes.InvalidArgument, "INVALID", nil},
		{wrap(&checkpoint.CommittedError{Job: "j", Step: 5, Attempt: "a"}), codes.AlreadyExists, "STEP_COMMITTED", map[string]string{"attempt": "a", "step": "5"}},
		{wrap(&staging.InProgressError{Target: checkpoint.Target{Job: "j", Step: 5, Rank: 2, Attempt: "a"}, State: staging.StateStaged}), codes.AlreadyExists, "SAVE_IN_PROGRESS", map[string]string{"rank": "2", "state": "staged"}},
		{wrap(&checkpoint.ChunkError{Step: 5, Rank: 1, Chunk: 3, Err: storage.ErrUnavailable}), codes.Unavailable, "STORAGE_UNAVAILABLE", map[string]string{"chunk": "3"}},
		{wrap(&checkpoint.ChunkError{Step: 5, Rank: 1, Chunk: 3, Err: storage.ErrNotFound}), codes.DataLoss, "CORRUPT", map[string]string{"chunk": "3"}},
		{wrap(fmt.Errorf("%w: manifest missing: %w", checkpoint.ErrCorrupt, storage.ErrNotFound)), codes.DataLoss, "CORRUPT", nil},
		{wrap(fmt.Errorf("lookup: %w", storage.ErrNotFound)), codes.NotFound, "STEP_NOT_FOUND", nil},
		{wrap(staging.ErrOverBudget), codes.ResourceExhausted, "OVER_BUDGET", nil},
		{wrap(arena.ErrFull), codes.ResourceExhausted, "ARENA_FULL", nil},
		{wrap(staging.ErrArenaFull), codes.ResourceExhausted, "ARENA_FULL", nil},
		{wrap(staging.ErrArenaTooLarge), codes.ResourceExhausted, "TOO_LARGE", nil},
		{wrap(arena.ErrClosed), codes.Unavailable, "SHUTTING_DOWN", nil},
		{wrap(&prefetch.ShardError{Shard: "train-1.tar", Detail: "bad"}), codes.DataLoss, "CORRUPT", map[string]string{"shard": "train-1.tar"}},
		{wrap(prefetch.ErrNotAllowed), codes.PermissionDenied, "PERMISSION_DENIED", nil},
		{wrap(storage.ErrSymlink), codes.FailedPrecondition, "STORE_UNSAFE", nil},
		{wrap(s3.ErrAccessDenied), codes.FailedPrecondition, "STORAGE_MISCONFIGURED", nil},
		{wrap(s3.ErrNoSuchBucket), codes.FailedPrecondition, "STORAGE_MISCONFIGURED", nil},
		{wrap(context.DeadlineExceeded), codes.DeadlineExceeded, "DEADLINE", nil},
		{errors.New("a bug"), codes.Internal, "INTERNAL", nil},
	} {
		st := status.Convert(toStatus(tc.err))
		var info *errdetails.ErrorInfo
		for _, d := range st.Details() {
			info, _ = d.(*errdetails.ErrorInfo)
		}
		if st.Code() != tc.code || info == nil || info.GetReason() != tc.reason || info.GetDomain() != ErrorDomain {
			t.Errorf("%v: %s %v, want %s %s", tc.err, st.Code(), info, tc.code, tc.reason)
			continue
		}
		for k, v := range tc.meta {
			if info.GetMetadata()[k] != v {
				t.Errorf("%v: metadata %v, want %s=%s", tc.err, info.GetMetadata(), k, v)
			}
		}
	}
}

// A core error that ran into budgets is shown with the flags that set
// them; the core's own message names none.
func TestExplainNamesTheFlags(t *testing.T) {
	err := budget.Wrap(fmt.Errorf("%w: the datasets' share is full", prefetch.ErrOverBudget), budget.DatasetShare, budget.StagingArena)
	st, _ := status.FromError(toStatus(err))
	if want := "the datasets' share is full (set by ckptd serve --dataset-arena-bytes, --staging-bytes)"; !strings.HasSuffix(st.Message(), want) {
		t.Errorf("message %q, want it to end %q", st.Message(), want)
	}
	if got := Explain(errors.New("plain")); got != "plain" {
		t.Errorf("Explain of an error without budgets = %q", got)
	}
}
