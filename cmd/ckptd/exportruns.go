package main

import "iter"

// span is [begin, end) in elements.
type span struct{ begin, end int64 }

// runs yields the contiguous runs of a piece of a row-major tensor: for
// each, where it lies in the piece's own (row-major) elements and the
// element offset where it starts in the full tensor. The piece has shape
// piece at offsets in a full tensor of shape full; the trailing dimensions
// it spans whole make one run, so a piece cut along the first dimension is
// a single run.
func runs(full, piece, offsets []int64) iter.Seq2[span, int64] {
	return func(yield func(span, int64) bool) {
		d := len(full)
		stride := make([]int64, d+1) // stride[j]: elements per step of dim j in full
		stride[d] = 1
		for j := d - 1; j >= 0; j-- {
			stride[j] = stride[j+1] * full[j]
		}
		k := d - 1 // the run covers dims k.. : the inner dims the piece spans whole, and dim k
		for k > 0 && piece[k] == full[k] {
			k--
		}
		if d == 0 {
			yield(span{0, 1}, 0)
			return
		}
		runLen := piece[k] * stride[k+1]
		outer := numel(piece[:k])
		idx := make([]int64, k) // index into the piece's outer dims
		for r := range outer {
			dst := offsets[k] * stride[k+1]
			for j := range k {
				dst += (offsets[j] + idx[j]) * stride[j+1]
			}
			if !yield(span{r * runLen, (r + 1) * runLen}, dst) {
				return
			}
			for j := k - 1; j >= 0; j-- { // next outer index, last dim fastest
				if idx[j]++; idx[j] < piece[j] {
					break
				}
				idx[j] = 0
			}
		}
	}
}
