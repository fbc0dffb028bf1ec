package hostile

import (
	"bytes"
	"context"
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
	// A partial restore hands out whole chunks; the client checks them
	// and finds the tensor where the header says, streamed too.
	want := daemontest.Shard(2, 1, 2).Tensors[1]
	for _, load := range []func(context.Context, *ckptd.LoadRequest) (*ckptd.Shard, error){c.Load, c.LoadStream} {
		got, err := load(daemontest.Ctx(t), &ckptd.LoadRequest{Step: 2, Rank: 1, Tensors: []string{want.Name}})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Tensors) != 1 || !bytes.Equal(got.Tensors[0].Data, want.Data) {
			t.Fatalf("partial restore: %d tensors", len(got.Tensors))
		}
	}
}
