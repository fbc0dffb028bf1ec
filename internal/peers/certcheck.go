package peers

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// CheckOwn checks this sidecar's certificate as its peers will: signed by
// the CA for both ends of a connection (serverAuth and clientAuth, and a
// key usage that allows signing), and naming self's host, the address the
// other sidecars dial (self is its entry in the peer list; "" or a host
// left empty skips that check). A certificate that fails would let the
// daemon start and every replication fail its TLS handshake, so serve
// refuses to start with it, saying what is wrong and how to fix it.
// Plaintext (no certificate) has nothing to check.
func (t TLS) CheckOwn(self string) error {
	if t.CertFile == "" {
		return nil
	}
	pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return fmt.Errorf("peer certificate: %w", err)
	}
	leaf := pair.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return fmt.Errorf("peer certificate %s: %w", t.CertFile, err)
		}
	}
	ca, err := os.ReadFile(t.CAFile)
	if err != nil {
		return fmt.Errorf("peer CA: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		return fmt.Errorf("peer CA %s: no PEM certificate in it", t.CAFile)
	}
	inter := x509.NewCertPool()
	for _, der := range pair.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	what := fmt.Sprintf("peer certificate %s (subject %q, %s)", t.CertFile, leaf.Subject.String(), sans(leaf))
	var problems []string
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		problems = append(problems, fmt.Sprintf("it is not signed by the CA in --peer-ca %s (%v): every peer would refuse it; "+
			"sign it with that CA, or give the CA that signed it", t.CAFile, err))
	} else {
		for _, u := range []struct {
			usage x509.ExtKeyUsage
			name  string
		}{{x509.ExtKeyUsageServerAuth, "serverAuth"}, {x509.ExtKeyUsageClientAuth, "clientAuth"}} {
			if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{u.usage}}); err != nil {
				problems = append(problems, fmt.Sprintf("it is not good for %s (its extended key usage, or its CA's, leaves it out), which a sidecar needs "+
					"since it both takes and opens peer connections: issue it with extendedKeyUsage = serverAuth, clientAuth (see docs/tiers.md)", u.name))
			}
		}
	}
	if leaf.KeyUsage != 0 && leaf.KeyUsage&x509.KeyUsageDigitalSignature == 0 {
		problems = append(problems, "its key usage leaves out digitalSignature, which TLS 1.3 needs of both ends: "+
			"issue it with keyUsage = critical, digitalSignature (see docs/tiers.md)")
	}
	if t.ServerName != "" {
		if err := leaf.VerifyHostname(t.ServerName); err != nil {
			problems = append(problems, fmt.Sprintf("it does not name %s (--peer-server-name), the name every peer checks it for; "+
				"issue it with subjectAltName = %s (see docs/tiers.md)", t.ServerName, sanFor(t.ServerName)))
		}
	} else if host, _, err := net.SplitHostPort(self); err == nil && host != "" {
		if err := leaf.VerifyHostname(host); err != nil {
			problems = append(problems, fmt.Sprintf("it does not name %s, the host the other sidecars dial this one at (its entry %s in the peer list), "+
				"so their TLS check of it fails; either issue it with subjectAltName = %s (see docs/tiers.md), "+
				"or list this sidecar by a name or address the certificate holds (--peers, the peers file or DNS, and --peer-advertise)",
				host, self, sanFor(host)))
		}
	}
	if len(problems) == 0 {
		return nil
	}
	return errors.New(what + ": " + strings.Join(problems, "; and "))
}

// sans lists a certificate's subject alternative names as openssl names
// them.
func sans(c *x509.Certificate) string {
	var out []string
	for _, d := range c.DNSNames {
		out = append(out, "DNS:"+d)
	}
	for _, ip := range c.IPAddresses {
		out = append(out, "IP:"+ip.String())
	}
	if len(out) == 0 {
		return "no subject alternative names"
	}
	return "SANs " + strings.Join(out, ", ")
}

// sanFor is the subjectAltName entry that names host.
func sanFor(host string) string {
	if net.ParseIP(host) != nil {
		return "IP:" + host
	}
	return "DNS:" + host
}
