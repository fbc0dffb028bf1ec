package peers

import (
	"io"
	"net"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/tiers"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// A peer's inventory, whatever its bytes: parseInventory never panics,
// keeps at most maxHeld shards, and only shards a sidecar can hold.
func FuzzParseInventory(f *testing.F) {
	good, _ := proto.Marshal(&pb.InventoryResponse{Shards: []*pb.HeldShard{
		{Step: 7, Rank: 1, WorldSize: 4, Attempt: "run1", MemoryOnly: true, ManifestHash: "xxh3:85501c4d0ed7df99"},
		{Step: -1, Rank: 9, WorldSize: 4, Attempt: "../x"},
		{Step: 1 << 62, Rank: -1, WorldSize: 1 << 30, Attempt: "a", ManifestHash: "md5:nope"},
	}})
	f.Add(good)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		resp := &pb.InventoryResponse{}
		if proto.Unmarshal(b, resp) != nil {
			return
		}
		held, dropped, err := parseInventory(resp)
		if err != nil {
			if len(resp.GetShards()) <= maxHeld {
				t.Fatalf("refused an inventory of %d shards: %v", len(resp.GetShards()), err)
			}
			return
		}
		if len(held)+dropped != len(resp.GetShards()) || len(held) > maxHeld {
			t.Fatalf("%d shards kept and %d left out of %d", len(held), dropped, len(resp.GetShards()))
		}
		for _, h := range held {
			tg := checkpoint.Target{Job: "job", Step: h.Step, Rank: h.Rank, WorldSize: h.WorldSize, Attempt: h.Attempt}
			if tg.Validate() != nil || h.ManifestHash != "" && !validHash(h.ManifestHash) {
				t.Fatalf("kept a shard no sidecar can hold: %+v", h)
			}
		}
	})
}

// A replica sent through gRPC, whatever its pieces, by a sender with the
// rights of an entry of a peer list: receive never panics, charges
// memory only once the sender may send the shard its header names
// (maySend) and no more than it announces, gives back every buffer it
// took when it fails, and returns exactly the bytes announced when it
// does not.
func FuzzReceiveReplica(f *testing.F) {
	hdr := func(h *pb.ReplicaHeader) []byte { b, _ := proto.Marshal(&pb.ReplicaPiece{Header: h}); return b }
	f.Add(hdr(&pb.ReplicaHeader{ManifestSize: 3, DataSize: 5, Job: "j", Step: 1, Rank: 2, WorldSize: 4, Attempt: "a"}), []byte("abcdefgh"), uint8(3), uint8(1))
	f.Add(hdr(&pb.ReplicaHeader{ManifestSize: 3, DataSize: 5, Job: "j", Step: 1, Rank: 0, WorldSize: 4, Attempt: "a"}), []byte("abcdefgh"), uint8(8), uint8(1))
	f.Add(hdr(&pb.ReplicaHeader{ManifestSize: 1 << 40, DataSize: 1 << 62, Job: "j", Step: 1, Rank: 2, WorldSize: 4, Attempt: "a"}), []byte{}, uint8(1), uint8(2))
	f.Add([]byte{0xff}, []byte("x"), uint8(1), uint8(0))
	list := []string{"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}
	self := list[0]
	f.Fuzz(func(t *testing.T, first, rest []byte, cut, from uint8) {
		local := tiers.New(tiers.Config{HotBytes: 1 << 20})
		defer local.Close()
		s := NewServer(local, 1<<20)
		s.members, s.replicas = func() ([]string, string) { return list, self }, 1
		sender := list[int(from)%len(list)]
		host, _, _ := net.SplitHostPort(sender)
		who := caller{ip: net.ParseIP(host)}
		checked := false
		var want checkpoint.Target
		check := func(h *pb.ReplicaHeader) (err error) {
			want, err = s.maySend(who, h)
			checked = err == nil
			return err
		}
		var taken, given int
		alloc := func(n int64) ([]byte, error) {
			if !checked {
				t.Fatal("memory charged before the sender's right to the shard was checked")
			}
			b, err := local.ReplicaBuffer(want, n)
			if err == nil {
				taken++
			}
			return b, err
		}
		giveBack := func(b []byte) { given++; local.ReturnBuffer(b) }
		msgs := replicaMessages(first, rest, int(cut))
		h, manifest, data, err := receive(func() (*pb.ReplicaPiece, error) {
			if len(msgs) == 0 {
				return nil, io.EOF
			}
			m := msgs[0]
			msgs = msgs[1:]
			return m, nil
		}, 1<<20, check, alloc, giveBack)
		if used, budget, _ := local.Stats(); used > budget {
			t.Fatalf("the hot tier holds %d of %d", used, budget)
		}
		if err != nil {
			if given != taken {
				t.Fatalf("failed (%v) and gave back %d of %d buffers", err, given, taken)
			}
			return
		}
		if !slices.Contains(Holders(list, sender, int(h.GetRank()), 1), self) {
			t.Fatalf("%s sent rank %d, which it does not send here", sender, h.GetRank())
		}
		if uint64(len(manifest)) != h.GetManifestSize() || uint64(len(data)) != h.GetDataSize() {
			t.Fatalf("received %d + %d bytes, the header says %d + %d", len(manifest), len(data), h.GetManifestSize(), h.GetDataSize())
		}
	})
}

// replicaMessages is a replica stream: a piece decoded from first (the
// header, if it holds one), then rest in pieces of cut bytes.
func replicaMessages(first, rest []byte, cut int) []*pb.ReplicaPiece {
	p := &pb.ReplicaPiece{}
	if proto.Unmarshal(first, p) != nil {
		p = &pb.ReplicaPiece{Data: first}
	}
	out := []*pb.ReplicaPiece{p}
	for n := max(cut, 1); len(rest) > 0; rest = rest[min(n, len(rest)):] {
		out = append(out, &pb.ReplicaPiece{Data: rest[:min(n, len(rest))]})
	}
	return out
}
