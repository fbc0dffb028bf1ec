package prefetch

import (
	"crypto/rand"
	"encoding/hex"
)

// Owner is who a session belongs to: the connection that opened it. Only
// the same owner may use or close a session and its deliveries; to any
// other, they do not exist (ErrUnknownSession). When Done closes, the
// owner's sessions are closed and their ring slots freed. The zero Owner
// is an in-process caller: its sessions are released only by CloseSession
// or the idle timeout.
type Owner struct {
	ID   string
	Done <-chan struct{}
	// Peer names the client for people (`ckptd status`): its uid and pid.
	Peer string
}

// gone reports whether the owner's connection has closed.
func (o Owner) gone() bool {
	if o.Done == nil {
		return false
	}
	select {
	case <-o.Done:
		return true
	default:
		return false
	}
}

// newID returns 128 random bits as 32 lowercase hex characters: session
// and delivery ids must not be guessable by another connection.
func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (it panics instead)
	return hex.EncodeToString(b[:])
}
