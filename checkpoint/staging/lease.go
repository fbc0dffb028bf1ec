package staging

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/ckptd/ckptd/budget"
	"github.com/ckptd/ckptd/checkpoint"
	"github.com/prometheus/client_golang/prometheus"
)

// Owner is who holds a lease: one client connection. Done is closed when
// the connection goes away; what the owner still holds then (save leases
// not yet committed, restore regions) is released, so a trainer that dies
// between BeginSave and CommitSave does not pin arena space until
// LeaseTimeout. The zero Owner is an in-process caller, never released
// that way.
//
// A connection can end while its process lives on (a stopped client cut
// off by keepalive) and may resume copying into its save regions: those
// regions are reused only once Exited says the process has ended, or, when
// it cannot tell, after ManagerConfig.ReuseFence. A nil Exited means there
// is no process to wait for.
type Owner struct {
	ID     string
	Done   <-chan struct{}
	Exited func() (exited, known bool)
	// Peer names the client for people (`ckptd status`): its uid and pid.
	Peer string
}

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

type leaseKind int

const (
	saveLease leaseKind = iota
	restoreLease
)

func (k leaseKind) String() string { return [...]string{"save", "restore"}[k] }

// lease is a region of the arena held by a save or a restore.
type lease struct {
	id        string
	kind      leaseKind
	owner     string
	peer      string // Owner.Peer
	region    Region // Length 0: nothing allocated
	size      int64  // bytes of the region the lease covers
	target    checkpoint.Target
	layout    *checkpoint.Layout
	metadata  []byte
	committed bool
	recovered bool // replayed from an earlier process's journal
	// A save moved to the spill folder: its bytes mapped from there
	// (unmap undoes it) and what it books of the folder's budget.
	spilled    []byte
	unmap      func()
	spillBytes int64
	check      *precheck // a save's look at storage for its step's commit record
	copyCheck  *checkpoint.CopyCheck
	inPlace    *inPlaceRead // a restore served from the hot mapping: no region
	cost       int64        // charged to TableBudget
	begun      time.Time
	expires    time.Time
}

// inPlaceRead is what a restore lease in place holds: the hot copy's
// bytes it hands out, where they lie in the hot mapping, and the pin that
// keeps them there until the lease ends.
type inPlaceRead struct {
	arenaID string
	offset  int64
	data    []byte
	unpin   func()
}

// LeaseInfo is what a client needs to use a region.
type LeaseInfo struct {
	ID     string
	Offset int64
	Length int64
	// ArenaID names the mapping of a restore in place (HotMapping.ID);
	// empty for the arena.
	ArenaID string
	// Check, for a save when the Manager checks copies, has the ends and
	// key of the chunks whose MACs CommitSave needs (no hashes).
	Check *checkpoint.CopyCheck
}

func (l *lease) info() LeaseInfo {
	i := LeaseInfo{ID: l.id, Offset: l.region.Offset, Length: l.size}
	if l.inPlace != nil {
		i.Offset, i.ArenaID = l.inPlace.offset, l.inPlace.arenaID
	}
	if l.copyCheck != nil {
		i.Check = &checkpoint.CopyCheck{Ends: l.copyCheck.Ends, Key: l.copyCheck.Key}
	}
	return i
}

// newLeaseID returns 128 random bits: a lease id is a capability, so it
// must not be guessable from another client's.
func newLeaseID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // never fails (crypto/rand panics rather)
	return hex.EncodeToString(b)
}

// addLease records a new lease for owner. A lease for an owner already
// gone is dropped at once: its connection closed while the request was
// being served, after the owner's leases were released. Call with mu.
func (mgr *Manager) addLease(l *lease, o Owner) error {
	l.peer = o.Peer
	mgr.leases.add(l, o.ID)
	if o.gone() {
		mgr.dropLease(l)
		return fmt.Errorf("%w: the client went away", context.Canceled)
	}
	if o.Done != nil && mgr.leases.watch(o.ID) {
		mgr.watchers.Go(func() { mgr.watchOwner(o) })
	}
	return nil
}

// watchOwner releases what o holds once it goes away.
func (mgr *Manager) watchOwner(o Owner) {
	select {
	case <-o.Done:
	case <-mgr.ctx.Done():
		return
	}
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	open, held, pins := mgr.leases.ownerGone(o.ID)
	for _, unpin := range pins { // a reader's copies are void once it is gone
		unpin()
	}
	for _, l := range open {
		if l.kind == saveLease { // its writer may resume: see Owner
			held = append(held, l.region)
			l.region = Region{}
		}
		mgr.dropLease(l)
	}
	if n := len(open); n > 0 {
		mgr.m.LeasesReleased.WithLabelValues("disconnect").Add(float64(n))
		mgr.log.Info("client went away; released its leases", "leases", n)
	}
	mgr.leases.orphan(o, held, time.Now().Add(mgr.cfg.ReuseFence))
	mgr.freeOrphans(time.Now())
}

// freeOrphans frees the regions of gone owners whose processes have
// ended (see Owner). Call with mu.
func (mgr *Manager) freeOrphans(now time.Time) {
	for _, r := range mgr.leases.endedOrphans(now) {
		mgr.freeRegion(r)
	}
}

// reapLoop ends expired leases once a second.
func (mgr *Manager) reapLoop() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-mgr.ctx.Done():
			return
		case now := <-t.C:
			mgr.reap(now)
			mgr.mu.Lock()
			closing := mgr.closing
			mgr.mu.Unlock()
			if closing {
				return
			}
		}
	}
}

// reap ends leases past their timeout. The lease id stops working at
// once; its region is freed too unless its owner is connected, since a
// live client may still be copying into it: that region is reused only
// once the owner goes, so a slow writer can never scribble over a region
// handed to someone else.
func (mgr *Manager) reap(now time.Time) {
	mgr.mu.Lock()
	defer mgr.mu.Unlock()
	for _, l := range mgr.leases.expired(now) {
		live := mgr.leases.live(l.owner)
		mgr.log.Warn("lease expired", "lease", l.id, "kind", l.kind, "bytes", l.region.Length,
			"region_held_until_client_exits", live)
		mgr.m.LeasesReleased.WithLabelValues("expired").Inc()
		if live {
			mgr.leases.hold(l)
		}
		mgr.dropLease(l)
	}
	mgr.freeOrphans(now)
	mgr.saves.gc(now)
}

// dropLease ends an uncommitted lease and frees its region. Call with mu.
func (mgr *Manager) dropLease(l *lease) {
	mgr.leases.remove(l)
	if l.kind == saveLease {
		mgr.saves.clearStaging(l.target)
	}
	mgr.letGo(l)
}

// letGo frees what l holds: its region, or the pin of its bytes in place.
// Call with mu.
func (mgr *Manager) letGo(l *lease) {
	mgr.freeRegion(l.region)
	if l.inPlace != nil {
		l.inPlace.unpin()
		l.inPlace = nil
	}
}

// leaseTable is the Manager's open leases by id, with what ending them
// safely needs: whose each one is and until when, which owners are
// watched, the regions of expired leases whose owners live (a writer may
// still be copying into them, so they are reused only once it goes), and
// the TableBudget that open saves' tensor tables and metadata are charged
// to. Manager.mu guards it.
type leaseTable struct {
	byID     map[string]*lease
	watching map[string]bool     // owners with a watchOwner goroutine
	held     map[string][]Region // by owner: regions of its expired leases
	pins     map[string][]func() // by owner: unpins of its expired leases in place
	orphans  []orphan            // regions of gone owners whose processes may live
	budget   int64               // ManagerConfig.TableBudget
	tables   int64               // charged to budget
	gauge    prometheus.Gauge    // Metrics.TableBytes
}

func newLeaseTable(budget int64, gauge prometheus.Gauge) leaseTable {
	return leaseTable{byID: map[string]*lease{}, watching: map[string]bool{}, held: map[string][]Region{}, pins: map[string][]func(){}, budget: budget, gauge: gauge}
}

// add records l as owner's.
func (t *leaseTable) add(l *lease, owner string) {
	l.owner = owner
	t.byID[l.id] = l
}

// watch marks owner as watched and reports whether it was not yet.
func (t *leaseTable) watch(owner string) bool {
	if t.watching[owner] {
		return false
	}
	t.watching[owner] = true
	return true
}

// live reports whether owner is a connection still open.
func (t *leaseTable) live(owner string) bool { return owner != "" && t.watching[owner] }

// lookup returns o's lease id, or nil. Another owner's lease is as unknown
// as one never granted.
func (t *leaseTable) lookup(id string, o Owner) *lease {
	l := t.byID[id]
	if l == nil || l.owner != o.ID {
		return nil
	}
	return l
}

// remove forgets l and gives back what it was charged; its region is the
// caller's to free.
func (t *leaseTable) remove(l *lease) {
	delete(t.byID, l.id)
	t.uncharge(l)
}

// expired returns the uncommitted leases past their expiry at now.
func (t *leaseTable) expired(now time.Time) []*lease {
	var out []*lease
	for _, l := range t.byID {
		if !l.committed && !now.Before(l.expires) {
			out = append(out, l)
		}
	}
	return out
}

// hold keeps l's region (or its pin in place) for its owner, to be
// freed when the owner goes, and takes it from l.
func (t *leaseTable) hold(l *lease) {
	t.held[l.owner] = append(t.held[l.owner], l.region)
	l.region = Region{}
	if l.inPlace != nil { // the client may still be copying out of it
		t.pins[l.owner] = append(t.pins[l.owner], l.inPlace.unpin)
		l.inPlace = nil
	}
}

// orphan is what a gone owner held that its process may still write to.
type orphan struct {
	regions []Region
	exited  func() (exited, known bool) // nil: no process to wait for
	until   time.Time                   // when exited cannot tell
}

// heldBytes is the size of the regions kept for expired leases and gone
// owners.
func (t *leaseTable) heldBytes() int64 {
	var n int64
	for _, rs := range t.held {
		for _, r := range rs {
			n += r.Length
		}
	}
	for _, o := range t.orphans {
		for _, r := range o.regions {
			n += r.Length
		}
	}
	return n
}

// orphan keeps regions until o's process ends (or, when that cannot be
// told, until until).
func (t *leaseTable) orphan(o Owner, regions []Region, until time.Time) {
	if len(regions) > 0 {
		t.orphans = append(t.orphans, orphan{regions: regions, exited: o.Exited, until: until})
	}
}

// endedOrphans returns, and forgets, the orphaned regions whose process
// has ended.
func (t *leaseTable) endedOrphans(now time.Time) []Region {
	var free []Region
	kept := t.orphans[:0]
	for _, o := range t.orphans {
		if o.ended(now) {
			free = append(free, o.regions...)
		} else {
			kept = append(kept, o)
		}
	}
	clear(t.orphans[len(kept):])
	t.orphans = kept
	return free
}

func (o orphan) ended(now time.Time) bool {
	if o.exited == nil {
		return true
	}
	exited, known := o.exited()
	return exited || !known && !now.Before(o.until)
}

// ownerGone stops watching owner and returns what it still held: its
// uncommitted leases, and the regions and pins in place of its expired
// ones (no longer held).
func (t *leaseTable) ownerGone(owner string) ([]*lease, []Region, []func()) {
	delete(t.watching, owner)
	var open []*lease
	for _, l := range t.byID {
		if l.owner == owner && !l.committed {
			open = append(open, l)
		}
	}
	held, pins := t.held[owner], t.pins[owner]
	delete(t.held, owner)
	delete(t.pins, owner)
	return open, held, pins
}

// journaled counts the committed save leases: saves accepted and not yet
// durable.
func (t *leaseTable) journaled() int {
	n := 0
	for _, l := range t.byID {
		if l.kind == saveLease && l.committed {
			n++
		}
	}
	return n
}

// charge books n bytes of the budget for l.
func (t *leaseTable) charge(l *lease, n int64) error {
	if t.tables+n > t.budget {
		return budget.Wrap(fmt.Errorf("%w: the tensor tables and metadata of open saves, and the open restores, would hold %d bytes, more than their budget (%d); "+
			"wait for saves to drain, release restores, save fewer tensors at once, or raise the budget", ErrOverBudget, t.tables+n, t.budget), budget.TensorTables)
	}
	t.tables += n
	l.cost += n
	t.gauge.Set(float64(t.tables))
	return nil
}

// book charges l's table and metadata whatever the budget: l is a save
// recovered from the journal, acknowledged already.
func (t *leaseTable) book(l *lease) {
	l.cost = tableCost(l) + int64(len(l.metadata))
	t.tables += l.cost
	t.gauge.Set(float64(t.tables))
}

// refund gives back n of the bytes charged for l.
func (t *leaseTable) refund(l *lease, n int64) {
	t.tables -= n
	l.cost -= n
	t.gauge.Set(float64(t.tables))
}

// uncharge gives back everything charged for l.
func (t *leaseTable) uncharge(l *lease) {
	t.tables -= l.cost
	l.cost = 0
	t.gauge.Set(float64(t.tables))
}
