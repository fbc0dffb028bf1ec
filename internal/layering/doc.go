// Package layering holds no code: its test enforces the module's layering.
// The core packages (checkpoint, prefetch, storage and everything under
// them) know nothing of gRPC or protobuf and import no internal/ package,
// so that a program outside this module can use them and the daemon's
// transport can change without touching them.
package layering
