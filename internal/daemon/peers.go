package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"

	"github.com/ckptd/ckptd/internal/peers"
)

// PeerOptions are serve's settings for replicas on peer sidecars.
type PeerOptions struct {
	Peers     []string
	PeersFile string
	PeersDNS  string
	Listen    string
	Advertise string
	Replicas  int
	TLS       peers.TLS
	// InsecureNetwork lets --peer-insecure reach peers off loopback.
	InsecureNetwork bool
	// Require makes serve fail to start unless every peer listed at start
	// answers (and, with TLS, accepts the handshake both ways).
	Require   bool
	discovery peers.Discovery // set by setup when the list is discovered
}

// setup checks the flags and returns the peers' client and the server's
// credentials, or nils when no peers are configured.
func (p *PeerOptions) setup(ctx context.Context, hotBytes int64, log *slog.Logger) (*peers.Client, peers.Creds, error) {
	sources := 0
	for _, set := range []bool{len(p.Peers) > 0, p.PeersFile != "", p.PeersDNS != ""} {
		if set {
			sources++
		}
	}
	switch {
	case sources == 0 && p.Listen != "":
		return nil, peers.Creds{}, errors.New("--peer-listen without --peers, --peers-file or --peers-dns")
	case sources == 0:
		return nil, peers.Creds{}, nil
	case sources > 1:
		return nil, peers.Creds{}, errors.New("--peers, --peers-file and --peers-dns: give one")
	case hotBytes <= 0:
		return nil, peers.Creds{}, errors.New("peers need --hot-bytes: replicas are kept in the hot tier")
	case p.Listen == "":
		return nil, peers.Creds{}, errors.New("peers need --peer-listen")
	case p.Replicas < 1:
		return nil, peers.Creds{}, fmt.Errorf("--replicas %d: want 1 or more", p.Replicas)
	}
	list, self, err := p.members(ctx, log)
	if err != nil {
		return nil, peers.Creds{}, err
	}
	if err := p.plaintextAllowed(list); err != nil {
		return nil, peers.Creds{}, err
	}
	p.discovery.Vet = p.plaintextAllowed
	server, client, err := p.TLS.Credentials()
	if err != nil {
		return nil, peers.Creds{}, err
	}
	if err := p.TLS.CheckOwn(self); err != nil {
		return nil, peers.Creds{}, err
	}
	p.discovery.Check = p.TLS.CheckOwn
	if p.plaintext() {
		log.Warn("peers: checkpoints travel in plaintext, and whoever reaches the peer port may read and write replicas (--peer-insecure)",
			"off_loopback", p.InsecureNetwork)
	}
	return peers.NewClient(list, self, p.Replicas, client, log), server, nil
}

// members returns the first peer list and this sidecar's entry: the
// --peers list, checked, or what discovery finds (a DNS name that does
// not resolve yet is looked up again later: pods start before their
// service lists them).
func (p *PeerOptions) members(ctx context.Context, log *slog.Logger) ([]string, string, error) {
	self := p.Advertise
	if self == "" && len(p.Peers) > 0 {
		self = p.Listen
	}
	if len(p.Peers) > 0 {
		switch {
		case !slices.Contains(p.Peers, self):
			return nil, "", fmt.Errorf("this sidecar (%s: --peer-advertise, else --peer-listen) is not in --peers %v", self, p.Peers)
		case p.Replicas >= len(p.Peers):
			return nil, "", fmt.Errorf("--replicas %d: want 1 to %d (the other peers)", p.Replicas, len(p.Peers)-1)
		}
		return p.Peers, self, nil
	}
	_, port, err := net.SplitHostPort(p.Listen)
	if err != nil {
		return nil, "", fmt.Errorf("--peer-listen %q: %w", p.Listen, err)
	}
	p.discovery = peers.Discovery{File: p.PeersFile, DNS: p.PeersDNS, Self: p.Advertise, Port: port}
	list, self, err := p.discovery.Lookup(ctx)
	switch {
	case err != nil && p.PeersFile != "":
		return nil, "", err
	case err != nil:
		log.Warn("peers: the DNS name does not resolve yet; looking it up again every 10s", "err", err)
	case self == "":
		log.Warn("peers: this sidecar is not in the discovered list (yet); replicas are sent once it is", "peers", list,
			"hint", "--peer-advertise names this sidecar's entry")
	}
	return list, self, nil
}

// plaintext reports whether the peers talk without TLS.
func (p *PeerOptions) plaintext() bool { return p.TLS.Insecure && p.TLS.CertFile == "" }

// plaintextAllowed refuses --peer-insecure when the peer port listens,
// or a peer of list is, off loopback, unless --peer-insecure-network
// says the operator accepts what that allows: anyone on the network
// reads and writes replicas.
func (p *PeerOptions) plaintextAllowed(list []string) error {
	if !p.plaintext() || p.InsecureNetwork {
		return nil
	}
	for _, addr := range append([]string{p.Listen}, list...) {
		if !peers.Loopback(addr) {
			return fmt.Errorf("--peer-insecure with %s off loopback: without TLS, anyone who reaches the peer port reads every replica "+
				"and writes its own; use mutual TLS (--peer-cert, --peer-key, --peer-ca; docs/tiers.md has a recipe), "+
				"or add --peer-insecure-network to accept that on a network you trust", addr)
		}
	}
	return nil
}
