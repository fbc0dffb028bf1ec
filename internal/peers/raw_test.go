package peers

import (
	"bytes"
	"encoding/binary"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/ckptd/ckptd/proto/ckptd/v1"
)

// readFrame takes what writeFrame writes, and from a peer's bytes it
// refuses oversized frames before allocating them, never panics, and
// reads no further than its frame.
func FuzzReadFrame(f *testing.F) {
	var ok bytes.Buffer
	_ = writeFrame(&ok, &pb.ReplicaHeader{ManifestSize: 12, DataSize: 1 << 30, Committed: true, Error: "no"})
	f.Add(ok.Bytes())
	f.Add(binary.BigEndian.AppendUint32(nil, 1<<31))
	f.Add([]byte{0, 0, 0, 3, 0xff, 0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		hdr := &pb.ReplicaHeader{}
		if err := readFrame(r, hdr); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(b)
		if n > maxFrame || int(n)+4 != len(b)-r.Len() {
			t.Fatalf("a frame of %d bytes read %d", n, len(b)-r.Len())
		}
		var again bytes.Buffer
		if err := writeFrame(&again, hdr); err != nil {
			t.Fatal(err)
		}
		back := &pb.ReplicaHeader{}
		if err := readFrame(&again, back); err != nil || !proto.Equal(back, hdr) {
			t.Fatalf("round trip: %v", err)
		}
	})
}
