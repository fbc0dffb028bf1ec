package main

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/spf13/pflag"
	"google.golang.org/grpc/credentials"

	"github.com/ckptd/ckptd/internal/peers"
)

// peerOptions are serve's flags for replicas on peer sidecars.
type peerOptions struct {
	Peers     []string
	Listen    string
	Advertise string
	Replicas  int
	TLS       peers.TLS
}

func (p *peerOptions) register(fs *pflag.FlagSet) {
	fs.StringSliceVar(&p.Peers, "peers", nil, "the job's sidecars, host:port each (the same list on every node, this one included): each drained shard is sent to --replicas of them, chosen from its rank, and a restore asks them before storage; needs --hot-bytes")
	fs.StringVar(&p.Listen, "peer-listen", "", "TCP address for the peers' service (e.g. :7465)")
	fs.StringVar(&p.Advertise, "peer-advertise", "", "this sidecar's entry in --peers (default --peer-listen)")
	fs.IntVar(&p.Replicas, "replicas", 1, "peers that keep a copy of each shard")
	fs.StringVar(&p.TLS.CertFile, "peer-cert", "", "this sidecar's certificate (PEM) for the peers' mutual TLS")
	fs.StringVar(&p.TLS.KeyFile, "peer-key", "", "its private key (PEM)")
	fs.StringVar(&p.TLS.CAFile, "peer-ca", "", "the CA (PEM) that signs every peer's certificate; others are refused")
	fs.BoolVar(&p.TLS.Insecure, "peer-insecure", false, "send checkpoints to peers in plaintext, without TLS (trusted networks only)")
}

// setup checks the flags and returns the peers' client and the server's
// credentials, or nils when no peers are configured.
func (p *peerOptions) setup(hotBytes int64, log *slog.Logger) (*peers.Client, credentials.TransportCredentials, error) {
	if len(p.Peers) == 0 {
		if p.Listen != "" {
			return nil, nil, errors.New("--peer-listen without --peers")
		}
		return nil, nil, nil
	}
	self := p.Advertise
	if self == "" {
		self = p.Listen
	}
	switch {
	case hotBytes <= 0:
		return nil, nil, errors.New("--peers needs --hot-bytes: replicas are kept in the hot tier")
	case p.Listen == "":
		return nil, nil, errors.New("--peers needs --peer-listen")
	case !slices.Contains(p.Peers, self):
		return nil, nil, fmt.Errorf("this sidecar (%s: --peer-advertise, else --peer-listen) is not in --peers %v", self, p.Peers)
	case p.Replicas < 1 || p.Replicas >= len(p.Peers):
		return nil, nil, fmt.Errorf("--replicas %d: want 1 to %d (the other peers)", p.Replicas, len(p.Peers)-1)
	}
	server, client, err := p.TLS.Credentials()
	if err != nil {
		return nil, nil, err
	}
	if p.TLS.Insecure && p.TLS.CertFile == "" {
		log.Warn("peers: checkpoints travel in plaintext (--peer-insecure)")
	}
	return peers.NewClient(p.Peers, self, p.Replicas, client, log), server, nil
}
