package tiers

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/test/daemontest"
)

// certs are the files docs/tiers.md's certificate recipe makes for one
// node, in dir.
type certs struct{ dir, ca, cert, key string }

// recipeCerts runs docs/tiers.md's certificate recipe in a new folder for
// a node listed as name and ip, with edit (when not nil) applied to the
// recipe first: the tests' certificates are made as an operator's are.
func recipeCerts(t *testing.T, name, ip string, edit func(string) string) certs {
	t.Helper()
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Fatalf("the certificate recipe needs openssl: %v", err)
	}
	doc, err := os.ReadFile("../../docs/tiers.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllSubmatch(doc, -1)
	if len(blocks) != 1 {
		t.Fatalf("docs/tiers.md has %d sh blocks, want the recipe alone", len(blocks))
	}
	recipe := string(blocks[0][1])
	if edit != nil {
		recipe = edit(recipe)
	}
	return runRecipe(t, t.TempDir(), recipe, name, ip)
}

// node makes another node's certificate, listed as name and ip, signed by
// c's CA: the recipe's part for each node.
func (c certs) node(t *testing.T, name, ip string) certs {
	t.Helper()
	doc, err := os.ReadFile("../../docs/tiers.md")
	if err != nil {
		t.Fatal(err)
	}
	_, perNode, ok := strings.Cut(string(regexp.MustCompile("(?s)```sh\n(.*?)```").FindSubmatch(doc)[1]), "# Per node")
	if !ok {
		t.Fatal(`the recipe in docs/tiers.md has no "# Per node" part`)
	}
	dir := t.TempDir()
	for _, f := range []string{"ca.pem", "ca.key"} {
		b, err := os.ReadFile(filepath.Join(c.dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return runRecipe(t, dir, "# Per node"+perNode, name, ip)
}

func runRecipe(t *testing.T, dir, recipe, name, ip string) certs {
	t.Helper()
	cmd := daemontest.Command("bash", "-euo", "pipefail", "-c", recipe)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), "NODE="+name, "NODE_IP="+ip)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the certificate recipe: %v\n%s", err, out)
	}
	return certs{dir: dir, ca: filepath.Join(dir, "ca.pem"), cert: filepath.Join(dir, "node.pem"), key: filepath.Join(dir, "node.key")}
}

// args are serve's flags for these certificates.
func (c certs) args() []string {
	return []string{"--peer-cert", c.cert, "--peer-key", c.key, "--peer-ca", c.ca}
}

// serveRefused runs ckptd serve with args, which must fail at start, and
// returns its exit code and what it wrote.
func serveRefused(t *testing.T, args ...string) (int, string) {
	t.Helper()
	dir := t.TempDir()
	cmd := daemontest.Command(daemontest.Bin(t), append([]string{"serve", "--socket", filepath.Join(dir, "ckptd.sock"),
		"--storage", filepath.Join(dir, "store"), "--arena-dir", daemontest.ArenaDir(), "--staging-bytes", "16MiB"}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		return daemontest.ExitCode(err), out.String()
	case <-time.After(testtime.Scale(time.Minute)):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("serve %v started:\n%s", args, out.String())
	}
	return 0, ""
}

// A certificate its peers would refuse fails serve at start, naming the
// certificate's subject, its names and the fixes: one without a name for
// the address this sidecar is listed at, one not good for client
// connections.
func TestPeerCertificateChecked(t *testing.T) {
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	peerArgs := []string{"--hot-bytes", "1MiB", "--peers", strings.Join(addrs, ","), "--peer-listen", addrs[0]}
	for _, tc := range []struct {
		name  string
		certs certs
		want  []string
	}{
		{"no SAN for the listed address", recipeCerts(t, "node0.example", "127.0.0.2", nil),
			[]string{`subject "CN=node0.example"`, "DNS:node0.example, IP:127.0.0.2", "does not name 127.0.0.1",
				"subjectAltName = IP:127.0.0.1", "--peer-advertise", "docs/tiers.md"}},
		{"no clientAuth", recipeCerts(t, "localhost", "127.0.0.1", func(r string) string {
			return strings.Replace(r, "serverAuth, clientAuth", "serverAuth", 1)
		}), []string{`subject "CN=localhost"`, "not good for clientAuth", "extendedKeyUsage = serverAuth, clientAuth"}},
	} {
		code, out := serveRefused(t, append(peerArgs, tc.certs.args()...)...)
		for _, w := range tc.want {
			if code != 2 || !strings.Contains(out, w) {
				t.Errorf("%s: exit %d, want 2 and %q in:\n%s", tc.name, code, w, out)
			}
		}
	}
}

// --peer-insecure (plaintext: whoever reaches the port reads and writes
// replicas) is refused off loopback unless --peer-insecure-network says
// the operator accepts that; on loopback it needs nothing more.
func TestPlaintextPeersOffLoopback(t *testing.T) {
	self := daemontest.ClosedAddr(t)
	_, port, _ := strings.Cut(self, ":")
	for name, args := range map[string][]string{
		"a peer off loopback":     {"--peers", self + ",192.0.2.1:7465", "--peer-listen", self},
		"listening on every host": {"--peers", self + ",127.0.0.1:1", "--peer-listen", ":" + port, "--peer-advertise", self},
	} {
		code, out := serveRefused(t, append([]string{"--hot-bytes", "1MiB", "--peer-insecure"}, args...)...)
		if code != 2 || !strings.Contains(out, "off loopback") || !strings.Contains(out, "--peer-insecure-network") || !strings.Contains(out, "--peer-cert") {
			t.Errorf("%s: exit %d:\n%s", name, code, out)
		}
	}
	d := daemontest.Start(t, "", "--hot-bytes", "1MiB", "--peer-insecure", "--peer-insecure-network",
		"--peers", self+",192.0.2.1:7465", "--peer-listen", self, "--shutdown-grace", "1s")
	if !strings.Contains(d.Logs(), "off_loopback=true") {
		t.Errorf("plaintext off loopback is not logged:\n%s", d.Logs())
	}
}

// At start, a sidecar makes the TLS handshake with each of its peers: a
// peer whose certificate another CA signed (or that refuses this one's)
// is named in an error, with what to do, rather than found out by every
// replica failing.
func TestPeerProbeNamesTheProblem(t *testing.T) {
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	args := func(n int, c certs) []string {
		return append([]string{"--hot-bytes", "1MiB", "--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addrs[n]}, c.args()...)
	}
	daemontest.Start(t, "", args(1, recipeCerts(t, "localhost", "127.0.0.1", nil))...) // another CA
	d := daemontest.Start(t, "", args(0, recipeCerts(t, "localhost", "127.0.0.1", nil))...)
	daemontest.WaitUntil(t, "the handshake with the peer of another CA is reported", func() bool {
		return strings.Contains(d.Logs(), "the TLS handshake with a peer fails") && strings.Contains(d.Logs(), addrs[1])
	})
	if !strings.Contains(d.Logs(), "not signed by this sidecar's --peer-ca") {
		t.Errorf("the report does not say what is wrong:\n%s", d.Logs())
	}
}

// With --peer-require, a peer whose handshake fails stops serve at
// start, with the peer and the fix, rather than a line in its log.
func TestPeerRequire(t *testing.T) {
	addrs := []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	args := func(n int, c certs) []string {
		return append([]string{"--hot-bytes", "1MiB", "--shutdown-grace", "1s", "--peers", strings.Join(addrs, ","), "--peer-listen", addrs[n]}, c.args()...)
	}
	daemontest.Start(t, "", args(1, recipeCerts(t, "localhost", "127.0.0.1", nil))...) // another CA
	code, out := serveRefused(t, append(args(0, recipeCerts(t, "localhost", "127.0.0.1", nil)), "--peer-require")...)
	if code == 0 || !strings.Contains(out, "--peer-require: the TLS handshake with peer "+addrs[1]) ||
		!strings.Contains(out, "not signed by this sidecar's --peer-ca") {
		t.Fatalf("serve --peer-require with a peer of another CA: exit %d\n%s", code, out)
	}
	// Peers of the same CA: it starts.
	c := recipeCerts(t, "localhost", "127.0.0.1", nil)
	addrs = []string{daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)}
	daemontest.Start(t, "", args(1, c)...)
	daemontest.Start(t, "", append(args(0, c), "--peer-require")...)
}
