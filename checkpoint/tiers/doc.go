// Package tiers keeps checkpoint shards in memory, the daemon's tiers
// above storage: the hot tier (the local ranks' shards of each job's
// newest steps, as the bytes a restore hands out, verified against their
// chunk hashes whenever served), replicas sent to the peers that keep a
// rank's copies and kept for them, and the persistent tier policy that
// keeps some steps in memory only (--persist-every, --persist-interval),
// converging across sidecars without a coordinator. A restore asks it for
// the strongest Source that holds a shard.
//
// It depends on the checkpoint format only; package staging, the daemon's
// runtime, owns one Tiers and tells it what drained, committed or was
// kept in memory. The peers' transport is behind the Peers interface.
package tiers
