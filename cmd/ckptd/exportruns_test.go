package main

import (
	"slices"
	"testing"
)

// Every element of a piece lands where the full tensor has it: checked by
// assembling pieces of a tensor of known values.
func TestRuns(t *testing.T) {
	for _, tc := range []struct {
		name   string
		full   []int64
		pieces [][2][]int64 // offsets, shape
		runs   int          // runs of the first piece
	}{
		{"scalar", nil, [][2][]int64{{nil, nil}}, 1},
		{"rows", []int64{4, 3}, [][2][]int64{{{0, 0}, {2, 3}}, {{2, 0}, {2, 3}}}, 1},
		{"columns", []int64{4, 6}, [][2][]int64{{{0, 0}, {4, 2}}, {{0, 2}, {4, 4}}}, 4},
		{"blocks 3-d", []int64{2, 4, 6}, [][2][]int64{{{0, 0, 0}, {2, 2, 6}}, {{0, 2, 0}, {2, 2, 3}}, {{0, 2, 3}, {2, 2, 3}}}, 2},
		{"whole", []int64{5}, [][2][]int64{{{0}, {5}}}, 1},
		{"inner cut", []int64{2, 3, 4}, [][2][]int64{{{0, 0, 0}, {2, 3, 1}}, {{0, 0, 1}, {2, 3, 3}}}, 6},
	} {
		n := numel(tc.full)
		want := make([]int64, n)
		for i := range want {
			want[i] = int64(i)
		}
		got := make([]int64, n)
		for i := range got {
			got[i] = -1
		}
		for p, pc := range tc.pieces {
			offsets, shape := pc[0], pc[1]
			// The piece's own elements, row-major, cut from want.
			var src []int64
			for i := range n {
				if in(index(i, tc.full), offsets, shape) {
					src = append(src, want[i])
				}
			}
			count := 0
			for s, dst := range runs(tc.full, shape, offsets) {
				copy(got[dst:dst+s.end-s.begin], src[s.begin:s.end])
				count++
			}
			if p == 0 && count != tc.runs {
				t.Errorf("%s: the first piece is %d runs, want %d", tc.name, count, tc.runs)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: assembled %v, want %v", tc.name, got, want)
		}
	}
}

// index is the multi-index of row-major element i of shape.
func index(i int64, shape []int64) []int64 {
	idx := make([]int64, len(shape))
	for j := len(shape) - 1; j >= 0; j-- {
		idx[j] = i % shape[j]
		i /= shape[j]
	}
	return idx
}

func in(idx, offsets, shape []int64) bool {
	for j := range idx {
		if idx[j] < offsets[j] || idx[j] >= offsets[j]+shape[j] {
			return false
		}
	}
	return true
}
