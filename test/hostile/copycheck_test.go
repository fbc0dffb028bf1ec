package hostile

import (
	"strconv"
	"testing"

	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/test/daemontest"
)

// The Go client answers the copy check of a daemon that shares its arena
// with a group: its saves, through the arena and streamed, commit and
// load as saved. (clients/python/tests/test_copycheck.py has the
// attacker: a group member who rewrites a staged save fails it.)
func TestGoClientAnswersCopyCheck(t *testing.T) {
	d := daemontest.Start(t, t.TempDir(), "--socket-group", strconv.Itoa(shareGID), "--chunk-size", "64KiB")
	c := d.Client()
	daemontest.SaveAll(t, c, []int64{1}, 2, false)
	daemontest.SaveAll(t, c, []int64{2}, 2, true)
	daemontest.CommittedAsSaved(t, d, c, []*ckptd.SaveRequest{daemontest.Shard(1, 0, 2), daemontest.Shard(2, 0, 2)})
}
