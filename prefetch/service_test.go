package prefetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/internal/arena"
	"github.com/ckptd/ckptd/internal/testtime"
	"github.com/ckptd/ckptd/storage"
	"github.com/ckptd/ckptd/storage/memstore"
	"github.com/ckptd/ckptd/storage/posix"
)

// shmArena is the daemon's shared-memory arena as the Service sees it, as
// internal/server.PrefetchArena fits it for ckptd serve (which these tests
// cannot import: it imports this package).
type shmArena struct{ *arena.Arena }

func (a shmArena) Alloc(ctx context.Context, n int64) (Region, error) {
	r, err := a.Arena.Alloc(ctx, n)
	return Region(r), err
}

func (a shmArena) Free(r Region) error { return a.Arena.Free(arena.Region(r)) }

// arenaUsed is how many bytes of its arena s's rings and batches hold.
func arenaUsed(s *Service) int64 { return s.arena.(shmArena).Used() }

// newService starts a service on an arena of its own; its Open serves the
// dataset b whatever the source says, unless cfg has one. It allows the
// sources s3://test/... unless cfg says otherwise, and puts the arena in
// cfg.ArenaDir when it names one.
func newService(t *testing.T, b storage.Backend, cfg ServiceConfig) *Service {
	t.Helper()
	dir := cfg.ArenaDir
	if dir == "" {
		dir = t.TempDir()
	}
	a, err := arena.Open(arena.Options{Dir: dir, Size: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	if cfg.Open == nil {
		cfg.Open = func(context.Context, string) (storage.Backend, error) { return nopClose{b}, nil }
	}
	if cfg.Allow == nil {
		cfg.Allow = []string{"s3://test"}
	}
	if cfg.Slots == 0 {
		cfg.Slots, cfg.SlotBytes = 2, 1<<20
	}
	s, err := NewService(shmArena{a}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// nopClose keeps a test's backend open when the service closes its copy.
type nopClose struct{ storage.Backend }

func (nopClose) Close() error { return nil }

// connection is an Owner whose connection the test closes.
func connection(id string) (Owner, func()) {
	done := make(chan struct{})
	return Owner{ID: id, Done: done}, func() { close(done) }
}

// posixDataset is a dataset at the root of its backend, as a source is.
func posixDataset(t *testing.T, shards, perShard, payload int) storage.Backend {
	t.Helper()
	dir := t.TempDir()
	writeDataset(t, dir, shards, perShard, payload)
	b, err := posix.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var hex128 = regexp.MustCompile(`^[0-9a-f]{32}$`)

const src = "s3://test/src" // what newService's Open serves

func TestSessionsBelongToTheirConnection(t *testing.T) {
	s := newService(t, posixDataset(t, 2, 10, 100), ServiceConfig{})
	ctx := context.Background()
	alice, aliceGone := connection("alice")
	bob, _ := connection("bob")
	spec := Spec{BatchSize: 4, WorldSize: 1}
	id, _, err := s.OpenSession(ctx, alice, src, spec)
	if err != nil {
		t.Fatal(err)
	}
	if !hex128.MatchString(id) {
		t.Fatalf("session id %q is not 128 random bits in hex", id)
	}
	d, lease, _, err := s.Next(ctx, alice, id, nil)
	if err != nil || d == nil || !hex128.MatchString(lease) {
		t.Fatalf("next: %v, lease %q", err, lease)
	}
	// Another connection, or the in-process owner, cannot see either id.
	for _, who := range []Owner{bob, {}} {
		if _, _, _, err := s.Next(ctx, who, id, nil); !errors.Is(err, ErrUnknownSession) {
			t.Errorf("%q's next on another's session: %v", who.ID, err)
		}
		if err := s.CloseSession(who, id); !errors.Is(err, ErrUnknownSession) {
			t.Errorf("%q closed another's session: %v", who.ID, err)
		}
	}
	bobs, _, err := s.OpenSession(ctx, bob, src, spec)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := s.Next(ctx, bob, bobs, []string{lease}); !errors.Is(err, ErrUnknownSession) {
		t.Errorf("bob released alice's delivery: %v", err)
	}
	// Alice's connection closes: her session and its ring go within a second.
	used := arenaUsed(s)
	aliceGone()
	deadline := time.Now().Add(testtime.Scale(10 * time.Second))
	for arenaUsed(s) > used-2<<20 {
		if time.Now().After(deadline) {
			t.Fatalf("%v after the connection closed, the arena still holds %d bytes (had %d)", testtime.Scale(10*time.Second), arenaUsed(s), used)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, _, _, err := s.Next(ctx, alice, id, nil); !errors.Is(err, ErrUnknownSession) {
		t.Fatalf("next on a closed connection's session: %v", err)
	}
	// Bob's session is untouched.
	if _, _, _, err := s.Next(ctx, bob, bobs, nil); err != nil {
		t.Fatalf("bob's session after alice left: %v", err)
	}
	// A session opened for a connection already gone is released at once.
	if _, _, err := s.OpenSession(ctx, alice, src, spec); err == nil {
		t.Fatal("opened a session for a closed connection")
	}
	if err := s.CloseSession(bob, bobs); err != nil {
		t.Fatal(err)
	}
	if arenaUsed(s) != 0 {
		t.Fatalf("%d arena bytes still used with no session open", arenaUsed(s))
	}
}

// The in-process owner (no connection) keeps its sessions until it closes them.
func TestInProcessOwner(t *testing.T) {
	s := newService(t, posixDataset(t, 1, 5, 10), ServiceConfig{})
	id, _, err := s.OpenSession(context.Background(), Owner{}, src, Spec{BatchSize: 2, WorldSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	var release []string
	for {
		_, lease, _, err := s.Next(context.Background(), Owner{}, id, release)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		release, n = []string{lease}, n+1
	}
	if n != 3 {
		t.Fatalf("%d batches of 5 samples by 2", n)
	}
	if err := s.CloseSession(Owner{}, id); err != nil {
		t.Fatal(err)
	}
	if err := s.CloseSession(Owner{}, id); !errors.Is(err, ErrUnknownSession) || !strings.Contains(err.Error(), id) {
		t.Fatalf("second close: %v", err)
	}
}

// countingBackend counts the backends of a test that are open.
type countingBackend struct {
	storage.Backend
	open *atomic.Int64
}

func (c countingBackend) Close() error { c.open.Add(-1); return nil }

// Backends are shared by the sessions of a source, closed when unused
// for a while, and never more than MaxBackends at once: a stream of
// sources that fail to open or to list holds nothing.
func TestBackendsAreReleased(t *testing.T) {
	data, empty := posixDataset(t, 1, 4, 10), t.TempDir()
	var open, opens atomic.Int64
	s := newService(t, nil, ServiceConfig{MaxBackends: 4, BackendIdle: time.Hour, Open: func(_ context.Context, url string) (storage.Backend, error) {
		opens.Add(1)
		if strings.HasPrefix(url, "s3://test/bad") {
			return nil, errors.New("no such thing")
		}
		open.Add(1)
		if strings.HasPrefix(url, "s3://test/empty") {
			b, err := posix.New(empty)
			return countingBackend{b, &open}, err
		}
		return countingBackend{data, &open}, nil
	}})
	ctx := context.Background()
	spec := Spec{BatchSize: 2, WorldSize: 1}
	for i := range 200 {
		if _, _, err := s.OpenSession(ctx, Owner{}, fmt.Sprintf("s3://test/bad-%d", i), spec); !errors.Is(err, ErrInvalid) {
			t.Fatalf("a source that does not open: %v", err)
		}
		if _, _, err := s.OpenSession(ctx, Owner{}, fmt.Sprintf("s3://test/empty-%d", i), spec); !errors.Is(err, ErrInvalid) {
			t.Fatalf("an empty source: %v", err)
		}
		if n := open.Load(); n > 4 {
			t.Fatalf("%d backends open after %d empty sources; the cap is 4", n, i+1)
		}
	}
	// Two sessions of one source share its backend.
	opens.Store(0)
	a, _, err := s.OpenSession(ctx, Owner{}, "s3://test/data", spec)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := s.OpenSession(ctx, Owner{}, "s3://test/data", spec)
	if err != nil {
		t.Fatal(err)
	}
	if opens.Load() != 1 {
		t.Fatalf("two sessions of one source opened it %d times", opens.Load())
	}
	// Every backend in use: a new source is refused, not opened.
	s.backends.idleAfter = 0
	s.backends.reap() // the idle empty ones go
	held := []string{a, b}
	for i := range 3 {
		id, _, err := s.OpenSession(ctx, Owner{}, fmt.Sprintf("s3://test/data-%d", i), spec)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, id)
	}
	if _, _, err := s.OpenSession(ctx, Owner{}, "s3://test/data-x", spec); !errors.Is(err, ErrOverBudget) || !strings.Contains(err.Error(), "4 dataset sources") {
		t.Fatalf("a fifth source with four in use: %v", err)
	}
	for _, id := range held {
		if err := s.CloseSession(Owner{}, id); err != nil {
			t.Fatal(err)
		}
	}
	s.backends.reap()
	if n := open.Load(); n != 0 || s.backends.len() != 0 {
		t.Fatalf("%d backends open (%d in the pool) with no session and the idle time over", n, s.backends.len())
	}
}

// Rings and oversized batches come out of the datasets' share of the
// arena; what is left stays free for saves however many sessions open.
func TestDatasetShareOfTheArena(t *testing.T) {
	b := posixDataset(t, 2, 20, 100<<10) // 2 shards of 20 samples of 100 KiB
	s := newService(t, b, ServiceConfig{Slots: 2, SlotBytes: 1 << 20, ArenaBytes: 5 << 20, AllocWait: 100 * time.Millisecond})
	ctx := context.Background()
	small := Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1} // 400 KiB batches
	var ids []string
	for range 2 {
		id, _, err := s.OpenSession(ctx, Owner{}, src, small)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	_, _, err := s.OpenSession(ctx, Owner{}, src, small)
	if !errors.Is(err, ErrOverBudget) || !ranInto(err, budget.DatasetShare) ||
		!strings.Contains(err.Error(), "holds 2 such rings") {
		t.Fatalf("a third ring in a share that holds two: %v", err)
	}
	// The rest of the arena is the saves'.
	reg, err := s.arena.Alloc(ctx, s.arena.Size()-5<<20)
	if err != nil {
		t.Fatalf("the arena beyond the datasets' share: %v", err)
	}
	defer s.arena.Free(reg)
	// An oversized batch (2 MiB > a 1 MiB slot) is charged too: the share
	// has 1 MiB left, so it waits, then fails naming the flag.
	for _, id := range ids {
		_ = s.CloseSession(Owner{}, id)
	}
	big, _, err := s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 20, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	fill, _, err := s.OpenSession(ctx, Owner{}, src, small)
	if err != nil {
		t.Fatal(err)
	}
	_, _, _, err = s.Next(ctx, Owner{}, big, nil)
	if !errors.Is(err, ErrOverBudget) || !ranInto(err, budget.DatasetShare) {
		t.Fatalf("an oversized batch beyond the share: %v", err)
	}
	_ = s.CloseSession(Owner{}, fill)
	_ = s.CloseSession(Owner{}, big)
	big, _, err = s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 20, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, _, _, err := s.Next(ctx, Owner{}, big, nil)
	if err != nil || d.slot || d.Region.Length != 20*(100<<10+1) {
		t.Fatalf("an oversized batch with room: %v, %+v", err, d)
	}
	_ = s.CloseSession(Owner{}, big)
	if s.budget.used.Load() != 0 || arenaUsed(s) != reg.Length {
		t.Fatalf("with no session open: %d bytes charged, %d arena bytes used", s.budget.used.Load(), arenaUsed(s))
	}
}

// A session has at most as many deliveries out as its ring has slots,
// oversized ones included. A client that asks for more while holding
// them all cannot have seen them all: it gets the oldest again.
func TestDeliveriesPerSessionAreBounded(t *testing.T) {
	b := posixDataset(t, 1, 40, 100<<10)
	s := newService(t, b, ServiceConfig{Slots: 2, SlotBytes: 256 << 10, ArenaBytes: 32 << 20})
	ctx := context.Background()
	id, _, err := s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 4, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	var leases []string
	for range 2 {
		_, lease, _, err := s.Next(ctx, Owner{}, id, nil)
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, lease)
	}
	d, again, _, err := s.Next(ctx, Owner{}, id, nil)
	if err != nil || d.Position != 4 || again == leases[0] {
		t.Fatalf("a third delivery with two held: %v, position %d; want the first again under a new id", err, d.Position)
	}
	if used := s.budget.used.Load(); used != 512<<10+2*4*(100<<10+1) {
		t.Fatalf("%d bytes charged; want the ring and two oversized batches", used)
	}
	if err := s.Release(Owner{}, id, leases[0]); err != nil { // its old id is still fine to release
		t.Fatal(err)
	}
	if d, _, _, err := s.Next(ctx, Owner{}, id, []string{again, leases[1]}); err != nil || d.Position != 12 {
		t.Fatalf("after releasing both: %v, position %d", err, d.Position)
	}
}

// A call that ends as its batch arrives does not cost the client the
// batch or its slot: the batch goes to the next call. One whose response
// was lost after all is freed by the client's next release.
func TestTimedOutCallsLoseNothing(t *testing.T) {
	s := newService(t, posixDataset(t, 3, 10, 1000), ServiceConfig{Slots: 2, SlotBytes: 1 << 20})
	ctx := context.Background()
	id, _, err := s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 2, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	var positions []int64
	var release []string
	for i := 0; ; i++ {
		// Calls whose context is over by the time a batch is there (the
		// filler has filled both slots meanwhile): each may take a batch
		// off the queue, and must put it back.
		for range 20 {
			if _, _, _, err := s.Next(ended, Owner{}, id, nil); !errors.Is(err, context.Canceled) && !errors.Is(err, io.EOF) {
				t.Fatalf("a call whose context ended: %v", err)
			}
		}
		d, lease, _, err := s.Next(ctx, Owner{}, id, release)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		positions = append(positions, d.Position)
		if i%3 == 1 {
			s.Undeliver(Owner{}, id, lease) // the adapter could not send it
			release = nil
			continue
		}
		release = []string{lease}
	}
	want := []int64{2, 4, 4, 6, 8, 8, 10, 12, 12, 14, 16, 16, 18, 20, 20, 22, 24, 24, 26, 28, 28, 30}
	if !slices.Equal(positions, want) {
		t.Fatalf("positions %v; want every batch once, and the undelivered ones again", positions)
	}
	// A response lost on the way: the client never names it, and the
	// release of the next one frees both.
	id, _, err = s.OpenSession(ctx, Owner{}, src, Spec{BatchSize: 2, WorldSize: 1, ShuffleWindow: 1})
	if err != nil {
		t.Fatal(err)
	}
	ss, _ := s.session(Owner{}, id)
	_, lost, _, _ := s.Next(ctx, Owner{}, id, nil)
	_, seen, _, _ := s.Next(ctx, Owner{}, id, nil)
	held := func() int { ss.mu.Lock(); defer ss.mu.Unlock(); return len(ss.held) }
	if held() != 2 {
		t.Fatalf("%d deliveries held, want 2", held())
	}
	if err := s.Release(Owner{}, id, seen); err != nil {
		t.Fatal(err)
	}
	if held() != 0 {
		t.Fatalf("%d deliveries held after releasing the second; want the lost first one freed too", held())
	}
	// Releasing again (a retried call) is fine; an id never handed out is not.
	if err := s.Release(Owner{}, id, lost); err != nil {
		t.Fatalf("releasing a delivery again: %v", err)
	}
	if err := s.Release(Owner{}, id, newID()); !errors.Is(err, ErrUnknownSession) {
		t.Fatalf("releasing an unknown delivery: %v", err)
	}
}

// With datasets off (--dataset-arena-bytes 0) a session is refused saying
// so, and the service counts no memory; with no source allowed, none.
func TestDatasetsOff(t *testing.T) {
	s := newService(t, memstore.New(), ServiceConfig{Off: true})
	_, _, err := s.OpenSession(context.Background(), Owner{}, "s3://test", Spec{BatchSize: 1, WorldSize: 1})
	if !errors.Is(err, ErrOverBudget) || !strings.Contains(err.Error(), "datasets are off") || !ranInto(err, budget.DatasetShare) {
		t.Fatalf("a session with datasets off: %v", err)
	}
	for _, cfg := range []ServiceConfig{{Off: true, Allow: []string{"/data"}}, {}} {
		if n := cfg.MemoryCeiling(1 << 30); n != 0 {
			t.Errorf("%+v: a ceiling of %d bytes with datasets off", cfg, n)
		}
	}
	if n := (ServiceConfig{Allow: []string{"/data"}}).MemoryCeiling(1 << 30); n == 0 {
		t.Error("no ceiling with datasets on")
	}
}

// ranInto reports whether err names budget n (the daemon adds its flag).
func ranInto(err error, n budget.Name) bool { return slices.Contains(budget.Of(err), n) }
