// Package daemon is `ckptd serve`: the wiring of the socket, storage,
// the staging arena, the checkpoint runtime (checkpoint/staging), the
// peers, the dataset service, health, metrics and shutdown. New starts a
// daemon from its Options, taking back every step if one fails; Serve
// serves it until its context ends, then drains; Close takes back one
// that will not be served. cmd/ckptd turns the command line into Options.
package daemon
