// Package staging is the daemon's checkpoint runtime: a Manager hands out
// leases on the staging arena, journals the saves it accepts so that a
// crash loses none, drains them to storage through the checkpoint format
// (package checkpoint), commits their steps, tracks each save's state for
// Wait and Status, and restores steps into the arena, from the strongest
// tier that holds them. The memory tiers (hot tier, replicas, the policy
// that keeps some steps in memory only) are package tiers, which a Manager
// owns and tells what drained, committed or stays in memory.
//
// It knows nothing of gRPC: internal/server adapts it to the socket's API,
// internal/peers to the peers' transport.
package staging
