package checkpoint

import (
	"context"
	"fmt"

	"github.com/ckptd/ckptd/storage"
)

// Jobs lists the jobs in a store: the folders at its root that hold a
// steps/ folder, in name order. It costs one delimiter listing of the root
// plus one per folder, whatever the number of steps.
func Jobs(ctx context.Context, b storage.Backend) ([]string, error) {
	var dirs []string
	if err := b.ListDirs(ctx, "", func(seg string) error {
		if ValidateName("job", seg) == nil {
			dirs = append(dirs, seg)
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("list jobs in %s: %w", b.Location(), err)
	}
	var jobs []string
	for _, d := range dirs {
		found := false
		err := b.ListDirs(ctx, d+"/", func(seg string) error {
			found = found || seg == "steps"
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("list jobs in %s: %w", b.Location(), err)
		}
		if found {
			jobs = append(jobs, d)
		}
	}
	return jobs, nil
}
