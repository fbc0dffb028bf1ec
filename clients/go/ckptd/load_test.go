//go:build linux

package ckptd

import (
	"bytes"
	"errors"
	"math"
	"testing"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// A restore header comes from the daemon: one whose tensors lie outside
// the region (an offset or length near 2^64, a sum that wraps) is an
// error, never a panic or an allocation of its size.
func TestShardFromRefusesCraftedHeaders(t *testing.T) {
	region := []byte("0123456789abcdef")
	for _, tc := range []struct {
		name        string
		off, length uint64
		ok          bool
	}{
		{"whole region", 0, 16, true},
		{"empty at the end", 16, 0, true},
		{"inside", 4, 8, true},
		{"one past the end", 8, 9, false},
		{"offset past the end", 17, 0, false},
		{"length 2^63", 0, 1 << 63, false},
		{"offset 2^64-1", math.MaxUint64, 2, false},
		{"sum wraps to inside", 8, math.MaxUint64 - 3, false},
	} {
		h := &pb.RestoreHeader{Tensors: []*pb.Tensor{{Name: "t", Dtype: "U8", Offset: tc.off, Length: tc.length}}}
		s, err := shardFrom(h, region)
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v, want ok %v", tc.name, err, tc.ok)
			continue
		}
		if tc.ok && !bytes.Equal(s.Tensors[0].Data, region[tc.off:tc.off+tc.length]) {
			t.Errorf("%s: data %q", tc.name, s.Tensors[0].Data)
		}
	}
}

func FuzzShardFrom(f *testing.F) {
	f.Add(uint64(0), uint64(16), uint64(4), uint64(4), 16)
	f.Add(uint64(math.MaxUint64), uint64(2), uint64(0), uint64(0), 16)
	f.Add(uint64(8), uint64(math.MaxUint64-3), uint64(1), uint64(1<<62), 0)
	f.Fuzz(func(t *testing.T, off1, len1, off2, len2 uint64, size int) {
		if size < 0 || size > 1<<16 {
			return
		}
		region := make([]byte, size)
		h := &pb.RestoreHeader{Tensors: []*pb.Tensor{{Name: "a", Offset: off1, Length: len1}, {Name: "b", Offset: off2, Length: len2}}}
		s, err := shardFrom(h, region)
		if err != nil {
			return
		}
		for _, tn := range s.Tensors {
			if len(tn.Data) > size {
				t.Fatalf("tensor %s of %d bytes from a %d-byte region", tn.Name, len(tn.Data), size)
			}
		}
	})
}

// A restore's copy is refused unless it has the MACs the daemon's check
// says, and a check that does not cover the bytes is refused too.
func TestCheckRestored(t *testing.T) {
	key := make([]byte, 32)
	mac := func(b []byte) uint64 {
		h, err := newMAC(key)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = h.Write(b)
		return macSum(h)
	}
	data := []byte("0123456789")
	good := &pb.CopyCheck{ChunkEnds: []uint64{4, 10}, ChunkHashes: []uint64{mac(data[:4]), mac(data[4:])}, Key: key}
	if err := checkRestored(good, data); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []*pb.CopyCheck{
		{ChunkEnds: []uint64{4, 10}, ChunkHashes: []uint64{mac(data[:4]), 1}, Key: key},
		{ChunkEnds: []uint64{4, 9}, ChunkHashes: good.ChunkHashes, Key: key},
		{ChunkEnds: []uint64{6, 4, 10}, ChunkHashes: []uint64{0, 0, 0}, Key: key},
		{ChunkEnds: []uint64{10}, ChunkHashes: nil, Key: key},
		{ChunkEnds: good.ChunkEnds, ChunkHashes: good.ChunkHashes, Key: []byte("short")},
		{},
	} {
		if err := checkRestored(bad, data); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%v: %v", bad, err)
		}
	}
}

// The MAC is BLAKE3 keyed, its first 8 bytes little-endian: the values
// the Python client (the blake3 package) computes for the same key.
func TestMACAgreesWithPython(t *testing.T) {
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i)
	}
	for _, tc := range []struct {
		data []byte
		want uint64
	}{{[]byte("abc"), 3111729887497725293}, {make([]byte, 1<<20), 6762411022668853654}} {
		h, err := newMAC(key)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = h.Write(tc.data)
		if got := macSum(h); got != tc.want {
			t.Errorf("%d bytes: %d, want %d", len(tc.data), got, tc.want)
		}
	}
}
