package peers

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"time"
)

// Discovery finds a job's sidecars when they are not listed by hand: from
// a file (one host:port per line, '#' comments; a launcher or a config map
// writes it, best to a temporary name then renamed over it) or from a DNS name that resolves to every sidecar's address
// (a Kubernetes headless service), with the peers' port. The list is
// looked up again every Every, so nodes that come and go are followed.
type Discovery struct {
	File  string
	DNS   string // name:port
	Every time.Duration
	// Self is this sidecar's entry; "" finds it in the list: the entry
	// whose host is one of this host's addresses or its name, on Port.
	Self string
	Port string
	// Check, when set, checks this sidecar's entry once it is found or
	// changes (its certificate names it: TLS.CheckOwn); a failure is
	// logged as an error, the start having passed.
	Check func(self string) error
	// Vet, when set, refuses a list (it is logged, and the last one
	// kept): plaintext peers off loopback.
	Vet func(list []string) error
}

// DefaultEvery is how often a discovered list is looked up again.
const DefaultEvery = 10 * time.Second

// maxPeers bounds a discovered list.
const maxPeers = 4096

// Enabled reports whether the list is discovered at all.
func (d Discovery) Enabled() bool { return d.File != "" || d.DNS != "" }

// Lookup returns the list as it stands now, sorted, and this sidecar's
// entry in it ("" when it is not there).
func (d Discovery) Lookup(ctx context.Context) (list []string, self string, err error) {
	switch {
	case d.File != "" && d.DNS != "":
		return nil, "", errors.New("a peer file and a peer DNS name: give one")
	case d.File != "":
		list, err = readPeerFile(d.File)
	default:
		list, err = resolvePeers(ctx, d.DNS)
	}
	if err != nil {
		return nil, "", err
	}
	if len(list) == 0 { // a file caught being rewritten, most likely: write it to a temporary name and rename it
		return nil, "", errors.New("no peers listed")
	}
	slices.Sort(list)
	list = slices.Compact(list)
	if len(list) > maxPeers {
		return nil, "", fmt.Errorf("%d peers, more than %d", len(list), maxPeers)
	}
	return list, d.self(list), nil
}

func (d Discovery) self(list []string) string {
	if d.Self != "" {
		if slices.Contains(list, d.Self) {
			return d.Self
		}
		return ""
	}
	local := localAddrs()
	for _, p := range list {
		host, port, err := net.SplitHostPort(p)
		if err == nil && port == d.Port && local[host] {
			return p
		}
	}
	return ""
}

// localAddrs is this host's IP addresses, as text, and its names (a
// launcher writes a peer file of host names: Slurm's node list).
func localAddrs() map[string]bool {
	out := map[string]bool{}
	if name, err := os.Hostname(); err == nil {
		out[name] = true
		short, _, _ := strings.Cut(name, ".")
		out[short] = true
	}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			out[ipn.IP.String()] = true
		}
	}
	return out
}

func readPeerFile(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("peer file: %w", err)
	}
	defer f.Close()
	var list []string
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		if line == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(line); err != nil {
			return nil, fmt.Errorf("peer file %s line %d: %q is not host:port", path, n, line)
		}
		if len(list) == maxPeers {
			return nil, fmt.Errorf("peer file %s: more than %d peers", path, maxPeers)
		}
		list = append(list, line)
	}
	return list, sc.Err()
}

func resolvePeers(ctx context.Context, nameport string) ([]string, error) {
	name, port, err := net.SplitHostPort(nameport)
	if err != nil {
		return nil, fmt.Errorf("peer DNS name %q: want name:port", nameport)
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupHost(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("peer DNS name: %w", err)
	}
	list := make([]string, 0, len(ips))
	for _, ip := range ips {
		list = append(list, net.JoinHostPort(ip, port))
	}
	return list, nil
}

// Watch looks the list up every d.Every until ctx ends, handing c each
// list that differs from the one it has. A failed lookup keeps the old
// list (logged): a DNS hiccup must not drop every replica.
func (c *Client) Watch(ctx context.Context, d Discovery, log *slog.Logger) {
	every := d.Every
	if every <= 0 {
		every = DefaultEvery
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		list, self, err := d.Lookup(ctx)
		if err != nil {
			log.Warn("peers: looking the list up again failed; keeping the last one", "err", err)
			continue
		}
		if d.Vet != nil {
			if err := d.Vet(list); err != nil {
				log.Error("peers: the list changed to one this sidecar refuses; keeping the last one", "peers", list, "err", err)
				continue
			}
		}
		_, was := c.Members()
		if c.SetMembers(list, self) {
			log.Info("peers: the list changed", "peers", list, "self", self)
			if self != was && self != "" && d.Check != nil {
				if err := d.Check(self); err != nil {
					log.Error("peers: this sidecar's entry changed, and its peers cannot check its certificate against it: replicas it is sent will fail", "self", self, "err", err)
				}
			}
		}
	}
}

// Loopback reports whether addr (host:port) is on this host's loopback
// interface: its host is a loopback address or "localhost". An empty host
// listens on every interface.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
