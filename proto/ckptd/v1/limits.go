package ckptdv1

// The protocol's size limits, shared by the daemon and the Go client (the
// Python client copies them in ckptd/_limits.py, naming these). Written by
// hand next to the generated code: protoc does not touch this file.
const (
	// MaxMessageBytes is the largest message either side receives. Tensor
	// tables, metadata and streamed pieces are bounded well below it.
	MaxMessageBytes = 16 << 20
	// StreamChunkBytes is the data carried by one message of a streamed
	// save or restore.
	StreamChunkBytes = 1 << 20
)
