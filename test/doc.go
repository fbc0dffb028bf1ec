// Package test holds ckptd's end-to-end and fault tests. They build the
// real ckptd binary, start real `ckptd serve` processes on unix sockets in
// temporary folders, talk to them with the Go client, and check storage and
// CLI output; nothing is mocked.
package test
