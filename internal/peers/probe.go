package peers

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"
)

// probeFor is how long Probe keeps trying a peer that does not answer
// yet (sidecars of a job start in any order); probeEvery how often.
const (
	probeFor   = 2 * time.Minute
	probeEvery = 5 * time.Second
)

// Probe checks, once at start, that this sidecar can reach each of its
// peers' endpoints as it will to replicate: it dials each one and, with
// TLS, makes the handshake. A peer that refuses its certificate, or whose
// certificate this sidecar refuses (another CA, no name for the address
// dialled, expired), is logged as an error naming the peer and what is
// wrong: every replica between them would fail. A peer that does not
// answer is tried again for probeFor, then logged as a warning. It
// returns what it logged, joined (nil when every peer answered), when
// done or when ctx ends.
func (c *Client) Probe(ctx context.Context, log *slog.Logger) error {
	deadline := time.Now().Add(probeFor)
	list, self := c.Members()
	pending := map[string]bool{}
	for _, p := range list {
		if p != self {
			pending[p] = true
		}
	}
	var problems []error
	t := time.NewTicker(probeEvery)
	defer t.Stop()
	for len(pending) > 0 {
		for p := range pending {
			err := c.probe(ctx, p)
			var unreachable *net.OpError
			switch {
			case ctx.Err() != nil:
				return ctx.Err()
			case err == nil:
				delete(pending, p)
			case errors.As(err, &unreachable) && unreachable.Op == "dial" && time.Now().Before(deadline):
			case errors.As(err, &unreachable) && unreachable.Op == "dial":
				log.Warn("peers: a peer does not answer; replicas sent to it fail until it does", "peer", p, "err", err)
				problems = append(problems, fmt.Errorf("peer %s does not answer after %v: %w", p, probeFor, err))
				delete(pending, p)
			default:
				hint := tlsHint(err)
				log.Error("peers: the TLS handshake with a peer fails: every replica between the two will", "peer", p, "err", err,
					"hint", hint)
				problems = append(problems, fmt.Errorf("the TLS handshake with peer %s fails (%s): %w", p, hint, err))
				delete(pending, p)
			}
		}
		if len(pending) == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return errors.Join(problems...)
}

// probe dials peer's raw path and makes the TLS handshake, as a transfer
// would, then hangs up.
func (c *Client) probe(ctx context.Context, peer string) error {
	ctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	conn, err := c.dialRaw(ctx, peer)
	if err != nil {
		return err
	}
	return conn.Close()
}

// tlsHint says what to do about a handshake that failed.
func tlsHint(err error) string {
	var (
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
	)
	switch {
	case errors.As(err, &unknown):
		return "the peer's certificate is not signed by this sidecar's --peer-ca: give every sidecar of the job the same CA"
	case errors.As(err, &hostname):
		return "the peer's certificate does not name the address in the peer list: see docs/tiers.md for a certificate recipe, or --peer-server-name"
	case errors.As(err, &invalid):
		return "the peer's certificate is expired or not valid for TLS clients and servers"
	}
	return "the peer refused this sidecar's certificate (its CA, or its names), or speaks no TLS: check both sidecars' --peer-cert and --peer-ca"
}
