// Package proto holds ckptd's gRPC API definitions (ckptd/v1/ckptd.proto)
// and the Go code generated from them. Regenerate with `make proto`;
// TestGeneratedCodeIsCurrent fails when the committed code is stale.
package proto
