// Package test holds ckptd's end-to-end and fault tests, one package per
// subject so that each runs in minutes and packages run side by side:
// lifecycle (save, restore, crash, shutdown, export, start-up edges),
// attempts (runs of a job, format 1), s3 (a real MinIO), hostile (hostile
// clients, bad input, other local users), ops (health, status, logs,
// metrics), tiers (hot tier, peers, persistence policy) and datasets. They
// start real `ckptd serve` processes (daemontest), talk to them with the Go
// client and the CLI, and check storage and output; nothing is mocked.
package test
