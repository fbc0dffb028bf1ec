package staging

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// spill is a local-disk folder (ManagerConfig.SpillDir) that staged saves
// waiting to drain move to when the arena has no room for a new save
// (storage does not take bytes, or not as fast as saves come), so that new
// saves are still accepted: the arena's journal and bytes for as long as
// storage is away, on disk instead of in memory. Each save is two
// files, <lease id>.data (its region's bytes) and <lease id>.json (its
// journal entry), written in that order and each fsynced, the folder too,
// so that an entry always names whole bytes: the same crash guarantee as
// the arena's journal, and a node's reboot survived besides.
type spill struct {
	dir   string
	limit int64    // bytes the folder may hold; 0: what the disk takes
	lock  *os.File // flocked while this process uses the folder

	mu   sync.Mutex
	used int64
}

const (
	spillData  = ".data"
	spillEntry = ".json"
	spillLock  = ".lock"
)

// close lets another process use the folder; what it holds stays.
func (s *spill) close() { s.lock.Close() }

// openSpill makes dir (private to the daemon's user), locks it for this
// process (two daemons would each replay the other's saves) and counts
// what it holds already.
func openSpill(dir string, limit int64) (*spill, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("spill folder: %w", err)
	}
	if err := ownFolder(dir); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(dir, spillLock), os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("spill folder: %w", err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("spill folder %s: another daemon uses it (%w); give each daemon a folder of its own", dir, err)
	}
	s := &spill{dir: dir, limit: limit, lock: lock}
	des, err := os.ReadDir(dir)
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("spill folder: %w", err)
	}
	for _, de := range des {
		if fi, err := de.Info(); err == nil && fi.Mode().IsRegular() {
			s.used += fi.Size()
		}
	}
	return s, nil
}

func (s *spill) usedBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used
}

func (s *spill) path(id, ext string) string { return filepath.Join(s.dir, id+ext) }

// reserve books n bytes of the folder's budget.
func (s *spill) reserve(n int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.limit > 0 && s.used+n > s.limit {
		return false
	}
	s.used += n
	return true
}

func (s *spill) unreserve(n int64) {
	s.mu.Lock()
	s.used -= n
	s.mu.Unlock()
}

// write makes save id's bytes and journal entry durable in the folder.
// On an error nothing of it is left.
func (s *spill) write(id string, entry, data []byte) (err error) {
	n := int64(len(entry) + len(data))
	if !s.reserve(n) {
		return fmt.Errorf("the spill folder %s holds its limit of %d bytes", s.dir, s.limit)
	}
	defer func() {
		if err != nil {
			s.remove(id, n)
		}
	}()
	if err := writeSynced(s.path(id, spillData), data); err != nil {
		return err
	}
	tmp := s.path(id, spillEntry+".tmp")
	if err := writeSynced(tmp, entry); err != nil {
		return err
	}
	if err := os.Rename(tmp, s.path(id, spillEntry)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("spill: %w", err)
	}
	return syncDir(s.dir)
}

func writeSynced(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("spill: %w", err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("spill: write %s: %w", path, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("spill: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("spill: sync %s: %w", dir, err)
	}
	return nil
}

// remove deletes save id's files, entry first (so that a crash midway
// leaves bytes no entry names, which list removes), and gives back n
// bytes of the budget.
func (s *spill) remove(id string, n int64) {
	for _, ext := range []string{spillEntry, spillEntry + ".tmp", spillData} {
		_ = os.Remove(s.path(id, ext)) // a file already gone is what remove wants
	}
	s.unreserve(n)
}

// spilled is one save in the folder: its journal entry and the size of
// its bytes.
type spilled struct {
	id    string
	entry []byte
	size  int64
}

// list returns the saves in the folder, and removes what a crash left of
// a save midway (bytes without an entry, a half-written entry).
func (s *spill) list() ([]spilled, error) {
	des, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("spill folder: %w", err)
	}
	entries := map[string]bool{}
	for _, de := range des {
		if id, ok := strings.CutSuffix(de.Name(), spillEntry); ok && de.Type().IsRegular() {
			entries[id] = true
		}
	}
	var out []spilled
	for _, de := range des {
		name := de.Name()
		id, isData := strings.CutSuffix(name, spillData)
		switch {
		case strings.HasSuffix(name, spillEntry+".tmp"), isData && !entries[id]:
			if fi, err := de.Info(); err == nil {
				s.unreserve(fi.Size())
			}
			os.Remove(filepath.Join(s.dir, name))
		case strings.HasSuffix(name, spillEntry):
			id := strings.TrimSuffix(name, spillEntry)
			entry, err := os.ReadFile(filepath.Join(s.dir, name))
			if err != nil {
				return nil, fmt.Errorf("spill: %w", err)
			}
			fi, err := os.Lstat(s.path(id, spillData))
			if err != nil || !fi.Mode().IsRegular() {
				return nil, fmt.Errorf("spill: save %s has an entry and no bytes: %v", id, err)
			}
			out = append(out, spilled{id: id, entry: entry, size: fi.Size()})
		}
	}
	return out, nil
}

// mapData maps save id's bytes read-only; unmap undoes it.
func (s *spill) mapData(id string, size int64) (data []byte, unmap func(), err error) {
	if size == 0 {
		return nil, func() {}, nil
	}
	f, err := os.OpenFile(s.path(id, spillData), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("spill: %w", err)
	}
	defer f.Close()
	data, err = unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("spill: map %s: %w", f.Name(), err)
	}
	return data, func() { _ = unix.Munmap(data) }, nil
}

// spillAfter is how long a save waits for room in the arena before saves
// waiting to drain are moved to the spill folder.
const spillAfter = 100 * time.Millisecond

// spillSome moves queued saves, oldest first, out of the arena into the
// spill folder until n bytes of the arena are free or none is left to
// move. The oldest go first because they drain first when storage comes
// back: from the spill, as they are at the front of the queue.
func (mgr *Manager) spillSome(n int64) {
	mgr.spilling.Lock()
	defer mgr.spilling.Unlock()
	for freed := int64(0); freed < n; {
		mgr.mu.Lock()
		l := mgr.queue.takeInArena()
		mgr.mu.Unlock()
		if l == nil {
			return
		}
		size := l.region.Length
		if err := mgr.spillLease(l); err != nil {
			mgr.spillFailed(l, err)
			mgr.mu.Lock()
			mgr.queue.insertSpilled(l) // back where it was: the oldest in the arena
			mgr.mu.Unlock()
			return
		}
		freed += size
	}
}

// spillLease writes l's bytes and journal entry to the spill folder and,
// once they are durable, drops its arena journal entry and region and
// queues it again, at the front, to drain from the spilled copy. A crash
// between the two leaves it in both: recovery keeps the arena's.
func (mgr *Manager) spillLease(l *lease) error {
	entry, err := mgr.journalEntry(l)
	if err != nil {
		return err
	}
	data := mgr.arena.Bytes()[l.region.Offset : l.region.Offset+l.size]
	if err := mgr.spill.write(l.id, entry, data); err != nil {
		return err
	}
	booked := int64(len(entry)) + l.size
	mapped, unmap, err := mgr.spill.mapData(l.id, l.size)
	if err != nil {
		mgr.spill.remove(l.id, booked)
		return err
	}
	if err := mgr.arena.Journal().Delete(l.id); err != nil {
		// The arena's entry still names the region: keep the save there,
		// so that nothing else is written over what a restart would drain.
		unmap()
		mgr.spill.remove(l.id, booked)
		return fmt.Errorf("drop the arena's journal entry of a spilled save: %w", err)
	}
	mgr.mu.Lock()
	region := l.region
	l.region, l.spilled, l.unmap, l.spillBytes = Region{}, mapped, unmap, booked
	mgr.freeRegion(region)
	mgr.queue.insertSpilled(l)
	mgr.mu.Unlock()
	mgr.m.Spilled.Set(float64(mgr.spill.usedBytes()))
	mgr.log.Warn("storage does not take bytes and the arena is full: moved a staged save to the spill folder",
		"target", l.target, "bytes", l.size, "spill", mgr.spill.dir)
	return nil
}

// spillFailed says a save could not be moved to the spill folder, at most
// once a minute: every waiting save tries every 100 ms while it is full.
func (mgr *Manager) spillFailed(l *lease, err error) {
	now := time.Now().UnixNano()
	if last := mgr.spillLogged.Load(); now-last < int64(time.Minute) || !mgr.spillLogged.CompareAndSwap(last, now) {
		return
	}
	mgr.log.Error("could not move a staged save to the spill folder; it stays in the arena, and saves wait for room", "target", l.target, "err", err)
}

// dropSpilled forgets l's spilled copy once it is durable in storage.
func (mgr *Manager) dropSpilled(l *lease) {
	l.unmap()
	mgr.spill.remove(l.id, l.spillBytes)
	mgr.m.Spilled.Set(float64(mgr.spill.usedBytes()))
}

// recoverSpilled queues the saves an earlier process moved to the spill
// folder, oldest first, ahead of the arena's; a save the arena's journal
// held too and recovered (a crash in the middle of moving it) is the
// arena's, and its spilled copy goes.
func (mgr *Manager) recoverSpilled(recovered map[string]bool) error {
	if mgr.spill == nil {
		return nil
	}
	saves, err := mgr.spill.list()
	if err != nil {
		return err
	}
	var leases []*lease
	for _, sp := range saves {
		booked := int64(len(sp.entry)) + sp.size
		if recovered[sp.id] {
			mgr.spill.remove(sp.id, booked)
			continue
		}
		l, err := mgr.leaseFromEntry(sp.entry, false)
		if err == nil && l.size != sp.size {
			err = fmt.Errorf("%d bytes spilled for a region of %d", sp.size, l.size)
		}
		if err == nil {
			l.spilled, l.unmap, err = mgr.spill.mapData(sp.id, sp.size)
		}
		if err != nil {
			// Not replayable: it is not trusted, and kept for a person.
			mgr.log.Error("spilled save unusable; left in the spill folder, not replayed", "entry", sp.id, "err", err)
			continue
		}
		l.id, l.recovered, l.spillBytes = sp.id, true, booked
		leases = append(leases, l)
	}
	slices.SortStableFunc(leases, func(a, b *lease) int { return a.begun.Compare(b.begun) })
	for _, l := range leases {
		mgr.leases.add(l, "")
		mgr.leases.book(l)
		mgr.saves.setWorld(keyOf(l.target), StateStaged, nil, l.target.WorldSize)
		mgr.queue.insertSpilled(l)
		mgr.m.QueueDepth.Inc()
		mgr.log.Info("recovered spilled save", "target", l.target, "bytes", l.layout.DataSize)
	}
	mgr.m.Spilled.Set(float64(mgr.spill.usedBytes()))
	return nil
}

// has reports whether save id is in the folder, whole (its entry written).
func (s *spill) has(id string) bool {
	_, err := os.Stat(s.path(id, spillEntry))
	return err == nil
}

// ownFolder refuses a spill folder that is not a folder of the daemon's
// user, and makes it 0700: the saves replayed from it are trusted as
// staged (their copy checks included), so no one else may plant one.
func ownFolder(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("spill folder: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("spill folder %s: not a folder of this user (uid %d); give the daemon one of its own", dir, os.Geteuid())
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("spill folder: %w", err)
	}
	return nil
}
