package tiers

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/clients/go/ckptd"
	"github.com/ckptd/ckptd/internal/miniotest"
	"github.com/ckptd/ckptd/internal/peers"
	"github.com/ckptd/ckptd/test/daemontest"
)

// The evil-peer suite: a sidecar of a job, built without the race
// detector and run under a hard memory limit (RLIMIT_DATA), attacked by
// a peer holding a valid certificate of the job's CA (a compromised or
// buggy node). After each attack the sidecar is alive, its anonymous
// memory peaked under its hot tier plus a fixed margin, and the step it
// saved before restores byte-exact from its memory with storage killed.

const (
	victimHot = 64 << 20
	// victimMargin is what the sidecar may hold beyond its hot tier: the
	// Go runtime, gRPC's and the drains' buffers, garbage not returned.
	victimMargin = 192 << 20
	// victimDataLimit is its RLIMIT_DATA: private writable memory mapped
	// (the Go runtime maps its heap in 64 MiB arenas).
	victimDataLimit = 1 << 30
)

// victim is a sidecar under attack, the store it saves to, and the peer
// client an attacker holding a certificate of its CA uses.
type victim struct {
	*daemontest.Daemon
	srv   *miniotest.Server
	addr  string // its peer port
	evil  *peers.Client
	certs certs
	good  *ckptd.SaveRequest // step 1 rank 0 of 2: committed, in its hot tier
}

// startVictim starts a sidecar listed with one other peer (the attacker's
// entry) and saves step 1's rank 0 through it, which its hot tier keeps.
func startVictim(t *testing.T, extra ...string) *victim {
	t.Helper()
	self, evilAddr := daemontest.ClosedAddr(t), daemontest.ClosedAddr(t)
	return startVictimIn(t, []string{self, evilAddr}, self, evilAddr, recipeCerts(t, "localhost", "127.0.0.1", nil), extra...)
}

// startVictimIn is startVictim with the peer list, the victim's entry,
// the attacker's entry and the victim's certificates given.
func startVictimIn(t *testing.T, list []string, self, evilAddr string, c certs, extra ...string) *victim {
	t.Helper()
	srv, _, store := daemontest.S3Store(t)
	v := &victim{srv: srv, addr: self, certs: c, good: daemontest.Shard(1, 0, 1)}
	args := append([]string{"--hot-bytes", strconv.Itoa(victimHot), "--s3-retry-deadline", "1s", "--shutdown-grace", "1s",
		"--peers", strings.Join(list, ","), "--peer-listen", v.addr}, v.certs.args()...)
	d := daemontest.New(t, "", store, append(append(append([]string{}, daemontest.DefaultArgs...), args...), extra...)...)
	d.Env, d.Bin, d.DataLimit = srv.Env(), daemontest.PlainBin(t), victimDataLimit
	d.Start()
	v.Daemon = d
	if err := daemontest.Save(t, d.Client(), v.good).Wait(daemontest.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	daemontest.WaitUntil(t, "the good step in the hot tier", func() bool {
		st := daemontest.StatusJSON(t, d.Socket)
		return st.GetHot().GetShards() >= 1
	})
	v.evil = v.peer(t, v.certs, list, evilAddr)
	return v
}

// peer is a peer client of the victim's job as the sidecar at self with
// certificates c would have.
func (v *victim) peer(t *testing.T, c certs, list []string, self string) *peers.Client {
	t.Helper()
	tl := peers.TLS{CertFile: c.cert, KeyFile: c.key, CAFile: c.ca}
	_, creds, err := tl.Credentials()
	if err != nil {
		t.Fatal(err)
	}
	p := peers.NewClient(list, self, 1, creds, nil)
	t.Cleanup(p.Close)
	return p
}

// check asserts the sidecar survived an attack: alive, its memory peak
// bounded, and the good step restoring byte-exact from its memory with
// storage killed (which ends the test's use of storage).
func (v *victim) check(t *testing.T, attack string) {
	t.Helper()
	select {
	case <-v.Exited():
		t.Fatalf("%s: the sidecar died:\n%s", attack, v.Logs())
	default:
	}
	peak := anonPeak(t, v.Cmd.Process.Pid)
	t.Logf("%s: sidecar alive, anonymous memory peaked at %d MiB", attack, peak>>20)
	if peak > victimHot+victimMargin {
		t.Errorf("%s: anonymous memory peaked at %d MiB, more than the %d MiB hot tier and a %d MiB margin",
			attack, peak>>20, victimHot>>20, victimMargin>>20)
	}
	v.srv.Kill()
	got, err := v.Client().Load(daemontest.Ctx(t), &ckptd.LoadRequest{Latest: true})
	if err != nil {
		t.Fatalf("%s: the good step no longer restores with storage down: %v\n%s", attack, err, v.Logs())
	}
	daemontest.CheckShard(t, got, v.good)
	if got.Tier != "hot" {
		t.Fatalf("%s: the good step came from %q", attack, got.Tier)
	}
}

// anonPeak is the peak of a process's resident memory less its shared
// memory and file pages now (the arena, mlocked, and the binary): its
// heap and stacks at their highest, as the kernel kept it.
func anonPeak(t *testing.T, pid int) int64 {
	t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	var hwm, shmem, file int64
	for line := range strings.Lines(string(status)) {
		var name string
		var kb int64
		if n, _ := fmt.Sscanf(line, "%s %d kB", &name, &kb); n != 2 {
			continue
		}
		switch name {
		case "VmHWM:":
			hwm = kb << 10
		case "RssShmem:":
			shmem = kb << 10
		case "RssFile:":
			file = kb << 10
		}
	}
	return hwm - shmem - file
}

// forged is a shard of target with content of the attacker's.
func forged(t *testing.T, target checkpoint.Target, fill byte) (*checkpoint.Manifest, []byte) {
	t.Helper()
	const n = 1 << 20
	layout, err := checkpoint.NewLayout([]checkpoint.Tensor{{Name: "model.layers.0.weight", DType: dtype.U8, Shape: []int64{n}, Length: n}})
	if err != nil {
		t.Fatal(err)
	}
	data := []byte(strings.Repeat(string([]byte{fill}), n))
	return checkpoint.MemoryManifest(target, layout, nil, data, 4<<20), data
}

// A peer's replica over the sidecar's own shard (the original), even one
// claiming its step is committed, is refused: with storage killed the
// sidecar still restores its own bytes (it served the forgery).
func TestPeerCannotReplaceAnOriginal(t *testing.T) {
	v := startVictim(t)
	m, data := forged(t, checkpoint.Target{Job: "e2e", Step: 1, Rank: 0, WorldSize: 1, Attempt: daemontest.Attempt}, 0x66)
	err := v.evil.Replicate(daemontest.Ctx(t), m, data, true, false)
	if err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("a forged replica over the original: %v", err)
	}
	t.Logf("answer: %v", err)
	v.check(t, "a replica over the original")
}
