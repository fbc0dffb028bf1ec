package codec

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/klauspost/compress/zstd"
)

type input struct {
	name string
	data []byte
}

func roundTripInputs() []input {
	return []input{
		{"empty", []byte{}},
		{"nil", nil},
		{"1byte", []byte{42}},
		{"7bytes", []byte("ckptd!!")},
		{"odd1023", randomBytes(1023, 1)},
		{"odd65537", textLike(65537)},
		{"odd131073-f32", normalF32(131076, 2)[:131073]},
		{"random4M", randomBytes(chunkLen, 3)},
		{"zeros4M", make([]byte, chunkLen)},
		{"f32-4M", normalF32(chunkLen, 4)},
		{"bf16-4M", normalBF16(chunkLen, 5)},
		{"text-4M+3", textLike(chunkLen + 3)},
	}
}

func TestParse(t *testing.T) {
	for _, c := range allCodecs {
		got, err := Parse(string(c))
		if err != nil || got != c {
			t.Errorf("Parse(%q) = %q, %v", c, got, err)
		}
	}
	for _, s := range []string{"", "ZSTD", "gzip", "lz4 ", "lz4frame"} {
		_, err := Parse(s)
		if !errors.Is(err, ErrUnknownCodec) {
			t.Errorf("Parse(%q) error = %v, want ErrUnknownCodec", s, err)
			continue
		}
		for _, c := range allCodecs {
			if !strings.Contains(err.Error(), string(c)) {
				t.Errorf("Parse(%q) error %q does not list %q", s, err, c)
			}
		}
	}
}

func TestRoundTrip(t *testing.T) {
	for _, c := range allCodecs {
		for _, in := range roundTripInputs() {
			t.Run(fmt.Sprintf("%s/%s", c, in.name), func(t *testing.T) {
				enc, err := Encode(c, nil, in.data)
				if err != nil {
					t.Fatal(err)
				}
				if bound := MaxEncodedLen(c, len(in.data)); len(enc) > bound {
					t.Errorf("encoded %d bytes, MaxEncodedLen %d", len(enc), bound)
				}
				dec, err := Decode(c, nil, enc, len(in.data))
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(dec, in.data) {
					t.Fatal("round trip changed the data")
				}
			})
		}
	}
}

// TestMaxEncodedLen tries incompressible inputs of awkward sizes, around
// the block sizes of both codecs, where the worst-case overhead shows.
func TestMaxEncodedLen(t *testing.T) {
	sizes := []int{65535, 65536, 65537, 131071, 131072, 131073, 1<<20 + 1, 4<<20 - 1}
	for n := 0; n < 3000; n += 7 {
		sizes = append(sizes, n)
	}
	for _, c := range allCodecs {
		var buf []byte
		for _, n := range sizes {
			src := randomBytes(n, uint64(n))
			var err error
			if buf, err = Encode(c, buf, src); err != nil {
				t.Fatal(err)
			}
			if bound := MaxEncodedLen(c, n); len(buf) > bound {
				t.Errorf("%s: %d random bytes encoded to %d, MaxEncodedLen %d", c, n, len(buf), bound)
			}
		}
	}
}

// TestBuffersReused checks the hot-path contract: with big enough buffers
// neither direction allocates a new output buffer.
func TestBuffersReused(t *testing.T) {
	src := normalBF16(1<<20, 6)
	for _, c := range allCodecs {
		encBuf := make([]byte, 0, MaxEncodedLen(c, len(src)))
		enc, err := Encode(c, encBuf, src)
		if err != nil {
			t.Fatal(err)
		}
		if !sameArray(enc, encBuf) {
			t.Errorf("%s: Encode did not reuse a dst of MaxEncodedLen capacity", c)
		}
		decBuf := make([]byte, 3, len(src)) // exactly rawLen, and not empty
		dec, err := Decode(c, decBuf, enc, len(src))
		if err != nil {
			t.Fatal(err)
		}
		if !sameArray(dec, decBuf) || !bytes.Equal(dec, src) {
			t.Errorf("%s: Decode did not reuse a dst of rawLen capacity", c)
		}
	}
}

func sameArray(a, b []byte) bool {
	return cap(a) > 0 && cap(b) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

func TestNoAllocsWithBuffers(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector")
	}
	src := normalF32(256<<10, 7)
	for _, c := range allCodecs {
		encBuf := make([]byte, 0, MaxEncodedLen(c, len(src)))
		decBuf := make([]byte, 0, len(src))
		enc, _ := Encode(c, nil, src)
		allocs := testing.AllocsPerRun(20, func() {
			if _, err := Encode(c, encBuf, src); err != nil {
				t.Fatal(err)
			}
			if _, err := Decode(c, decBuf, enc, len(src)); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 0 {
			t.Errorf("%s: %.1f allocations per Encode+Decode with sized buffers", c, allocs)
		}
	}
}

func TestDecodeWrongLength(t *testing.T) {
	for _, c := range allCodecs {
		for _, in := range []input{{"empty", nil}, {"1byte", []byte{1}}, {"text", textLike(70000)}, {"f32", normalF32(1<<20, 8)}} {
			enc, err := Encode(c, nil, in.data)
			if err != nil {
				t.Fatal(err)
			}
			n := len(in.data)
			for _, rawLen := range []int{n - 1, n + 1, 2 * n, n + 1<<20, -1, MaxChunkLen + 1} {
				if rawLen == n {
					continue
				}
				out, err := Decode(c, nil, enc, rawLen)
				if !errors.Is(err, ErrCorrupt) {
					t.Errorf("%s/%s: Decode(rawLen %d of %d) = %d bytes, %v; want ErrCorrupt", c, in.name, rawLen, n, len(out), err)
				}
			}
		}
	}
}

// TestLZ4NilDst pins the workaround in decodeLZ4: the library's assembly
// decoder used to write through a nil dst for rawLen 0.
func TestLZ4NilDst(t *testing.T) {
	for _, src := range [][]byte{[]byte("000000000000000000"), {0x10, 'x'}, {0xf0}} {
		if _, err := Decode(LZ4, nil, src, 0); !errors.Is(err, ErrCorrupt) {
			t.Errorf("Decode(lz4, %q, 0): %v, want ErrCorrupt", src, err)
		}
	}
}

func TestDecodeDamaged(t *testing.T) {
	src := textLike(200000)
	for _, c := range []Codec{Zstd, LZ4} {
		enc, _ := Encode(c, nil, src)
		cases := map[string][]byte{
			"truncated": enc[:len(enc)-1],
			"half":      enc[:len(enc)/2],
			"empty":     nil,
			"trailing":  append(bytes.Clone(enc), 0xde, 0xad),
		}
		for name, bad := range cases {
			if _, err := Decode(c, nil, bad, len(src)); !errors.Is(err, ErrCorrupt) {
				t.Errorf("%s/%s: error %v, want ErrCorrupt", c, name, err)
			}
		}
	}
}

func TestUnknownCodec(t *testing.T) {
	if _, err := Encode("gzip", nil, []byte("x")); !errors.Is(err, ErrUnknownCodec) {
		t.Errorf("Encode: %v", err)
	}
	if _, err := Decode("gzip", nil, []byte("x"), 1); !errors.Is(err, ErrUnknownCodec) {
		t.Errorf("Decode: %v", err)
	}
	if got, want := MaxEncodedLen("gzip", 1000), MaxEncodedLen(Zstd, 1000); got < want {
		t.Errorf("MaxEncodedLen(unknown) = %d, below zstd's %d", got, want)
	}
}

func TestEncodeTooLarge(t *testing.T) {
	// Only the length is looked at, so a slice header over a small array
	// would do, but a real allocation keeps the test honest.
	if testing.Short() {
		t.Skip("allocates 1 GiB")
	}
	big := make([]byte, MaxChunkLen+1)
	if _, err := Encode(None, nil, big); err == nil {
		t.Error("Encode accepted a chunk over MaxChunkLen")
	}
}

// TestZstdFrameFormat pins what doc.go promises about the frames we write.
func TestZstdFrameFormat(t *testing.T) {
	for _, n := range []int{0, 1, 255, 1024, 1 << 20, 5 << 20} {
		enc, err := Encode(Zstd, nil, textLike(n))
		if err != nil {
			t.Fatal(err)
		}
		var h zstd.Header
		if err := h.Decode(enc); err != nil {
			t.Fatalf("n=%d: %v", n, err)
		}
		if !h.HasFCS || h.FrameContentSize != uint64(n) {
			t.Errorf("n=%d: content size %d (present %v)", n, h.FrameContentSize, h.HasFCS)
		}
		if h.HasCheckSum || h.DictionaryID != 0 || h.Skippable {
			t.Errorf("n=%d: header %+v", n, h)
		}
	}
}

func TestLZ4EmptyBlock(t *testing.T) {
	enc, err := Encode(LZ4, nil, nil)
	if err != nil || !bytes.Equal(enc, []byte{0}) {
		t.Errorf("Encode(lz4, empty) = %x, %v; want 00", enc, err)
	}
	for _, src := range [][]byte{nil, {0}} {
		if out, err := Decode(LZ4, nil, src, 0); err != nil || len(out) != 0 {
			t.Errorf("Decode(lz4, %x, 0) = %x, %v", src, out, err)
		}
	}
}

// TestZstdForeignFrames checks the reader accepts frames other writers
// produce: with a checksum, and streamed without a content size.
func TestZstdForeignFrames(t *testing.T) {
	src := textLike(300000)
	var buf bytes.Buffer
	w, err := zstd.NewWriter(&buf, zstd.WithEncoderLevel(zstd.SpeedBetterCompression))
	if err != nil {
		t.Fatal(err)
	}
	w.Write(src)
	w.Close()
	var h zstd.Header
	if err := h.Decode(buf.Bytes()); err != nil || h.HasFCS || !h.HasCheckSum {
		t.Fatalf("test frame not as intended: %+v, %v", h, err)
	}
	out, err := Decode(Zstd, nil, buf.Bytes(), len(src))
	if err != nil || !bytes.Equal(out, src) {
		t.Fatalf("Decode: %v", err)
	}
	// A bad checksum is corruption even though the content size is right.
	bad := bytes.Clone(buf.Bytes())
	bad[len(bad)-1] ^= 1
	if _, err := Decode(Zstd, nil, bad, len(src)); !errors.Is(err, ErrCorrupt) {
		t.Errorf("bad checksum: %v", err)
	}
}

func TestConcurrentUse(t *testing.T) {
	inputs := [][]byte{normalF32(300000, 9), textLike(200000), randomBytes(70000, 10)}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			c := allCodecs[g%len(allCodecs)]
			var enc, dec []byte
			for i := range 20 {
				src := inputs[(g+i)%len(inputs)]
				var err error
				if enc, err = Encode(c, enc, src); err != nil {
					t.Error(err)
					return
				}
				if dec, err = Decode(c, dec, enc, len(src)); err != nil || !bytes.Equal(dec, src) {
					t.Errorf("%s: round trip failed: %v", c, err)
					return
				}
			}
		})
	}
	wg.Wait()
}
