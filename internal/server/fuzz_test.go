package server

import (
	"context"
	"encoding/binary"
	"math"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ckptd/ckptd/checkpoint/staging"
	"github.com/ckptd/ckptd/internal/arena"
	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
	"github.com/ckptd/ckptd/storage/memstore"
)

// fuzzDTypes are the dtypes a fuzzed tensor picks from: valid ones of
// every size, and names the daemon must refuse.
var fuzzDTypes = []string{"U8", "F32", "BF16", "F64", "I64", "BOOL", "", "F33", "__metadata__"}

// tensorsFrom decodes a tensor table from fuzz bytes, 26 bytes a tensor:
// a dtype and a rank (0-3), three dimensions (int32, negative ones
// included), and an offset and a length as the client sends them (uint64,
// the top bit included).
func tensorsFrom(data []byte) []*pb.Tensor {
	var ts []*pb.Tensor
	for i := 0; len(data) >= 26 && i < 64; i++ {
		t := &pb.Tensor{Name: string(rune('a'+i%26)) + string(rune('a'+i/26)), Dtype: fuzzDTypes[int(data[0])%len(fuzzDTypes)]}
		for d := range int(data[1] % 4) {
			t.Shape = append(t.Shape, int64(int32(binary.LittleEndian.Uint32(data[2+4*d:]))))
		}
		t.Offset, t.Length = binary.LittleEndian.Uint64(data[10:]), binary.LittleEndian.Uint64(data[18:])
		ts = append(ts, t)
		data = data[26:]
	}
	return ts
}

func fuzzTensor(dtype byte, rank byte, dims [3]int32, off, length uint64) []byte {
	b := []byte{dtype, rank}
	for _, d := range dims {
		b = binary.LittleEndian.AppendUint32(b, uint32(d))
	}
	b = binary.LittleEndian.AppendUint64(b, off)
	return binary.LittleEndian.AppendUint64(b, length)
}

// FuzzBeginSaveTable sends fuzzed tensor tables through the daemon's
// BeginSave handler, onto a real Manager and arena: every table is either
// refused with a clear code (never INTERNAL, never a panic) or leased a
// region inside the arena that holds every tensor; the lease is aborted
// and the arena is empty again.
func FuzzBeginSaveTable(f *testing.F) {
	f.Add(fuzzTensor(1, 1, [3]int32{4}, 0, 16))
	f.Add(append(fuzzTensor(0, 1, [3]int32{1 << 30}, 1<<62, 1<<62), fuzzTensor(0, 1, [3]int32{1}, 3<<61, 1<<62)...)) // the 2^62 overflow
	f.Add(fuzzTensor(0, 1, [3]int32{0}, math.MaxUint64, 0))
	f.Add(fuzzTensor(2, 3, [3]int32{-1, -1, 2}, 0, 4))
	f.Add(append(fuzzTensor(1, 2, [3]int32{2, 2}, 0, 16), fuzzTensor(1, 2, [3]int32{2, 2}, 8, 16)...)) // overlapping
	a, err := arena.Open(arena.Options{Dir: f.TempDir(), Size: 1 << 20})
	if err != nil {
		f.Fatal(err)
	}
	mgr, err := staging.NewManager(CheckpointArena(a), memstore.New(), staging.ManagerConfig{
		DefaultJob: "j", StagingWait: time.Millisecond, TableBudget: 1 << 20})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { mgr.Close(context.Background()); a.Close() })
	s := &Checkpoint{mgr: mgr, arena: a}
	ctx := context.Background()
	target := &pb.SaveTarget{Step: 1, WorldSize: 1, Attempt: "fuzz"}
	f.Fuzz(func(t *testing.T, data []byte) {
		ts := tensorsFrom(data)
		resp, err := s.BeginSave(ctx, &pb.BeginSaveRequest{Target: target, Tensors: ts})
		if err != nil {
			switch status.Code(err) {
			case codes.InvalidArgument, codes.ResourceExhausted:
			default:
				t.Fatalf("table %v: %v", ts, err)
			}
			return
		}
		l := resp.GetLease()
		for _, tn := range ts {
			if tn.GetOffset() > l.GetLength() || tn.GetLength() > l.GetLength()-tn.GetOffset() {
				t.Fatalf("tensor %v outside its %d-byte region", tn, l.GetLength())
			}
		}
		if l.GetOffset()+l.GetLength() > uint64(a.Size()) {
			t.Fatalf("region [%d, +%d) outside the %d-byte arena", l.GetOffset(), l.GetLength(), a.Size())
		}
		if _, err := s.AbortSave(ctx, &pb.AbortSaveRequest{LeaseId: l.GetId()}); err != nil {
			t.Fatal(err)
		}
		if a.Used() != 0 {
			t.Fatalf("%d bytes of the arena still used after the abort", a.Used())
		}
	})
}
