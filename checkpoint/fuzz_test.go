package checkpoint

import (
	"encoding/binary"
	"encoding/json"
	"testing"

	"github.com/ckptd/ckptd/checkpoint/dtype"
)

// tableFrom decodes fuzz bytes into a BeginSave tensor table: each entry
// is 25 bytes (dtype index, two dims, offset, length), so the fuzzer can
// reach every corner of the int64 range.
func tableFrom(data []byte) []Tensor {
	dts := []dtype.DType{dtype.U8, dtype.F32, dtype.BF16, dtype.F64, "BAD"}
	var ts []Tensor
	for i := 0; len(data) >= 25 && i < 64; i++ {
		u := func(k int) int64 { return int64(binary.LittleEndian.Uint64(data[1+8*k:])) }
		t := Tensor{Name: string(rune('a'+i%26)) + string(rune('a'+i/26)), DType: dts[int(data[0])%len(dts)],
			Shape: []int64{u(0) >> 32, u(0) & 0xffffffff}, Offset: u(1), Length: u(2)}
		ts = append(ts, t)
		data = data[25:]
	}
	return ts
}

// FuzzNewLayout: whatever table a client sends, a layout that validates
// is consistent (no sums wrapped around), and planning its chunks stays
// proportional to its size.
func FuzzNewLayout(f *testing.F) {
	seed := func(ts ...[4]int64) []byte {
		var b []byte
		for _, t := range ts {
			b = append(b, 0)
			for _, v := range t[1:] {
				b = binary.LittleEndian.AppendUint64(b, uint64(v))
			}
			b[len(b)-24] = byte(t[0])
		}
		return b
	}
	f.Add(seed([4]int64{0, 1<<32 | 4, 0, 4}))
	f.Add(seed([4]int64{0, 1 << 62 >> 32 << 32, 1 << 62, 1 << 62}, [4]int64{0, 1, 3 << 61, 1 << 62})) // the 2^62 overflow
	f.Add(seed([4]int64{0, 0, 1<<63 - 1, 0}))
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := NewLayout(tableFrom(data))
		if err != nil {
			return
		}
		var sum int64
		for i, r := range l.Region {
			if r.Offset < 0 || r.Length < 0 || r.Offset+r.Length < r.Offset || r.Offset+r.Length > l.RegionSize {
				t.Fatalf("tensor %d [%d, +%d) outside a region of %d", i, r.Offset, r.Length, l.RegionSize)
			}
			sum += r.Length
			if sum < 0 {
				t.Fatal("data size wrapped")
			}
		}
		if sum != l.DataSize || l.DataSize > l.RegionSize {
			t.Fatalf("data size %d, tensors hold %d, region %d", l.DataSize, sum, l.RegionSize)
		}
		if l.RegionSize <= 64<<20 { // planning a huge region is the arena's to refuse
			if n := len(l.planChunks(4096, 0)); int64(n) > l.DataSize/4096+int64(len(l.Region))+1 {
				t.Fatalf("%d chunks for %d bytes", n, l.DataSize)
			}
		}
	})
}

// FuzzParseGroup: a group summary that parses is of the step, attempt and
// world size asked for, lists exactly its group's ranks by their canonical
// manifests, and adds no negative count.
func FuzzParseGroup(f *testing.F) {
	want := Target{Job: "j", Step: 1, WorldSize: 102, Attempt: "a"}
	refs := []ManifestRef{{Object: Target{Step: 1, Attempt: "a", Rank: 100}.manifestObject(), Hash: "xxh3:0123456789abcdef"},
		{Object: Target{Step: 1, Attempt: "a", Rank: 101}.manifestObject(), Hash: "xxh3:0123456789abcdef"}}
	good, _ := json.Marshal(groupSummary{Format: GroupFormat, Version: GroupVersion, Job: "j", Step: 1, Attempt: "a",
		WorldSize: 102, FirstRank: 100, Manifests: refs, Bytes: 8, StoredBytes: 8})
	f.Add(good, 100)
	f.Add([]byte(`{"format":"ckptd.group","version":1,"job":"j","step":1,"attempt":"a","world_size":102,"first_rank":0,"manifests":[]}`), 0)
	f.Add([]byte(`{"format":"ckptd.group","version":1,"bytes":-1}`), 100)
	f.Fuzz(func(t *testing.T, data []byte, first int) {
		if first < 0 || first >= want.WorldSize || first%groupRanks.size != 0 {
			return
		}
		g, err := parseGroup(data, want, first)
		if err != nil {
			return
		}
		_, end := groupOf(first, want.WorldSize)
		if g.Job != want.Job || g.Step != want.Step || g.Attempt != want.Attempt || len(g.Manifests) != end-first {
			t.Fatalf("accepted %+v for ranks %d-%d of %+v", g, first, end-1, want)
		}
		for i, ref := range g.Manifests {
			if ref.Object != (Target{Step: want.Step, Attempt: want.Attempt, Rank: first + i}).manifestObject() {
				t.Fatalf("rank %d's manifest %q is not the canonical name", first+i, ref.Object)
			}
		}
		if g.Bytes < 0 || g.StoredBytes < 0 || g.NonFinite < 0 || g.NonFiniteTensors < 0 {
			t.Fatalf("negative counts accepted: %+v", g)
		}
		rec := newRecord(want)
		if err := rec.addGroup(g); err != nil || rec.Bytes != g.Bytes {
			t.Fatalf("adding an accepted summary: %v", err)
		}
	})
}

// FuzzParseCommit: a commit record that parses names only canonical
// manifests of its own attempt.
func FuzzParseCommit(f *testing.F) {
	rec := CommitRecord{Format: CommitFormat, Version: 2, Job: "j", Step: 1, Attempt: "a", WorldSize: 1,
		Manifests: []ManifestRef{{Object: "steps/000000000001/a/rank-00000.manifest.json", Hash: "xxh3:0123456789abcdef"}}}
	good, _ := json.Marshal(rec)
	f.Add(good)
	f.Add([]byte(`{"format":"ckptd.commit","version":1,"job":"j","step":1,"world_size":1}`))
	f.Add([]byte(`{"format":"ckptd.commit","version":2,"job":"j","step":1,"attempt":"a","world_size":2,"manifests":[{"object":"../x","hash":"xxh3:0"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseCommit(data)
		if err != nil {
			return
		}
		for rank := range c.WorldSize {
			obj, _ := c.manifestObject(rank)
			if obj != (Target{Step: c.Step, Attempt: c.Attempt, Rank: rank}).manifestObject() {
				t.Fatalf("rank %d's manifest %q is not the canonical name", rank, obj)
			}
		}
	})
}
