package server

import (
	"fmt"
	"strings"

	"github.com/ckptd/ckptd/budget"
)

// serveFlags are the ckptd serve flags that set each budget: the core
// names a budget by what it bounds, and the daemon's errors name the
// setting a person changes.
var serveFlags = map[budget.Name][]string{
	budget.StagingArena:   {"--staging-bytes"},
	budget.TensorTables:   {"--tensor-table-bytes"},
	budget.Restores:       {"--restores"},
	budget.HotTier:        {"--hot-bytes"},
	budget.PersistPolicy:  {"--persist-every", "--persist-interval"},
	budget.DatasetShare:   {"--dataset-arena-bytes"},
	budget.RingSlots:      {"--ring-slots"},
	budget.SlotBytes:      {"--slot-bytes"},
	budget.ReadAhead:      {"--read-ahead-bytes"},
	budget.DatasetListing: {"--dataset-list-bytes"},
	budget.DatasetSources: {"--dataset-allow"},
	budget.DiskCache:      {"--disk-cache-dir", "--disk-cache-bytes"},
}

// Explain is err's message, followed by the ckptd serve flags that set the
// budgets it ran into, if any.
func Explain(err error) string {
	var flags []string
	for _, n := range budget.Of(err) {
		flags = append(flags, serveFlags[n]...)
	}
	if len(flags) == 0 {
		return err.Error()
	}
	return fmt.Sprintf("%s (set by ckptd serve %s)", err.Error(), strings.Join(flags, ", "))
}
