package budget_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/ckptd/ckptd/budget"
)

func TestOf(t *testing.T) {
	base := errors.New("over budget")
	inner := budget.Wrap(base, budget.StagingArena)
	outer := budget.Wrap(fmt.Errorf("stage step 3: %w", inner), budget.DatasetShare, budget.StagingArena)
	for _, tc := range []struct {
		err  error
		want []budget.Name
	}{
		{nil, nil},
		{base, nil},
		{inner, []budget.Name{budget.StagingArena}},
		{fmt.Errorf("wrapped: %w", outer), []budget.Name{budget.DatasetShare, budget.StagingArena}},
	} {
		if got := budget.Of(tc.err); !slices.Equal(got, tc.want) {
			t.Errorf("Of(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	if !errors.Is(outer, base) || outer.Error() != "stage step 3: over budget" {
		t.Errorf("a wrapped error is %q and matches its cause: %v", outer, errors.Is(outer, base))
	}
	if budget.Wrap(nil, budget.HotTier) != nil {
		t.Error("Wrap(nil) is not nil")
	}
}
