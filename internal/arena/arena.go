package arena

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Options configures Open.
type Options struct {
	// Dir holds the arena, its lock and its journal; it should be on tmpfs
	// (e.g. /dev/shm/ckptd-<id>) so that the staged bytes are memory, not
	// disk, and survive a daemon crash.
	Dir string
	// Size is the staging budget in bytes, rounded down to a whole 4 KiB
	// page so that the arena never exceeds it.
	Size int64
	// Lock mlocks the arena so that staged data is never swapped and CUDA
	// can register it as pinned memory cheaply. Failure is logged, not fatal.
	Lock bool
	// Shared lets the members of group SharedGID map the arena too (serve's
	// --socket-group): the directory becomes 0750 and the arena file 0660,
	// both of that group. The lock and the journal stay private to the
	// daemon's user. Members can read and write every staged region: the
	// group is the trust boundary, as it is for the socket.
	Shared    bool
	SharedGID int
	// DeferShare keeps a Shared arena private (0700, 0600) until Share:
	// for a daemon that must read what an earlier process staged before
	// any member can write it.
	DeferShare bool
	// LockWait bounds how long Open waits for the arena lock when its
	// holder is not running: a daemon killed a moment ago keeps the lock
	// until it has unmapped its (possibly large, mlocked) arena, which takes
	// seconds; a holder in another pid namespace cannot be seen at all. A
	// holder that is running fails Open at once with ErrInUse, as does any
	// holder when LockWait is 0.
	LockWait time.Duration
	// Fence is how long, on an arena kept from a crashed daemon (Reused),
	// Alloc waits before handing out any region: that daemon's clients may
	// still be copying into regions it had leased, which this process sees
	// as free. It applies to every user of the arena (checkpoint saves and
	// restores, dataset rings); Reserve, which re-takes journaled regions,
	// does not wait.
	Fence time.Duration
	// Owner is recorded in the lock beside the pid: the socket of the
	// daemon, so that a folder its dead daemon left can be named by what
	// would restart it (ReapStale).
	Owner string
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// created records what one Open made, so that a failed start can take it
// back (Discard) and leave the place as it found it.
type created struct{ dir, lock, journal, writers, file bool }

// access is who may use the arena directory and file.
type access struct {
	dirMode, fileMode os.FileMode
	gid               int // -1: leave the group alone
}

func (o Options) access() access {
	if o.Shared && !o.DeferShare {
		return o.sharedAccess()
	}
	return access{dirMode: dirMode, fileMode: privateMode, gid: -1}
}

func (o Options) sharedAccess() access {
	return access{dirMode: sharedDirMode, fileMode: sharedMode, gid: o.SharedGID}
}

// Arena is the daemon's side of the staging arena: the mapping, the region
// allocator and the journal. All methods are safe for concurrent use.
type Arena struct {
	dir     string
	path    string
	id      string // device:inode of the arena file, and a nonce of this Open
	size    int64
	locked  bool
	log     *slog.Logger
	alloc   *allocator
	journal *Journal
	writers *writers
	made    created
	reused  bool      // the file held a crashed daemon's staged saves
	fence   time.Time // no Alloc before this (Options.Fence)
	share   *access   // Options.DeferShare: what Share gives the group

	mu       sync.Mutex // guards mem and lockFile against Close
	mem      []byte
	lockFile *os.File
}

const (
	arenaFile     = "arena"
	lockFile      = "lock"
	journalDir    = "journal"
	dirMode       = 0o700
	privateMode   = 0o600
	sharedDirMode = 0o750
	sharedMode    = 0o660
)

// Open creates or reopens the arena in opts.Dir. An existing arena of the
// same size is reused as is: that is how staged data survives a restart.
// When Open fails it leaves behind nothing that it created.
func Open(opts Options) (*Arena, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if opts.Dir == "" {
		return nil, errors.New("arena: no directory given")
	}
	size := opts.Size &^ (pageSize - 1)
	if size <= 0 {
		return nil, fmt.Errorf("arena: size %d bytes is less than one %d-byte page", opts.Size, pageSize)
	}
	var made created
	lf, err := lockArena(opts, &made, log)
	if err != nil {
		// Whatever we created was made in a directory whose lock we do not
		// hold (or that we could not use): only an empty new one is ours.
		if made.dir {
			os.Remove(opts.Dir)
		}
		return nil, err
	}
	a, err := open(opts, size, log, lf, &made)
	if err != nil {
		lf.Close() // after open undid what it made, so no one else could see it half made
		return nil, err
	}
	return a, nil
}

// open opens the journal and the arena file under the lock lf. On failure
// it deletes what this Open made unless the journal holds entries (then
// nothing is touched: they name staged saves).
func open(opts Options, want int64, log *slog.Logger, lf *os.File, made *created) (a *Arena, err error) {
	var j *Journal
	defer func() {
		if err != nil && (j == nil || j.Len() == 0) {
			err = errors.Join(err, undo(opts.Dir, *made))
		}
	}()
	j, made.journal, err = openJournal(filepath.Join(opts.Dir, journalDir))
	if err != nil {
		return nil, err
	}
	w, recorded, err := openWriters(filepath.Join(opts.Dir, writersDir), log)
	if err != nil {
		return nil, err
	}
	made.writers = !recorded
	path := filepath.Join(opts.Dir, arenaFile)
	f, size, err := openArenaFile(path, want, j.Len(), opts.access(), made, log)
	if err != nil {
		return nil, err
	}
	id, err := fileID(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	// A file made again may get the inode of the one it replaces: the id
	// also names this opening, so every start tells clients to map anew.
	nonce := make([]byte, 8)
	_, _ = rand.Read(nonce)
	id += ":" + hex.EncodeToString(nonce)
	// The mapping outlives the descriptor; nothing else needs it.
	mem, err := populate(f, size)
	f.Close()
	if err != nil {
		return nil, err
	}
	a = &Arena{
		dir:     opts.Dir,
		path:    path,
		id:      id,
		size:    size,
		log:     log,
		alloc:   newAllocator(size &^ (pageSize - 1)),
		journal: j,
		writers: w,
		made:    *made,
		reused:  !made.file,
		// A daemon that kept no record of its writers' regions left this
		// arena: any of it may be being written, so all of it waits.
		fence:    fenceUntil(!made.file && !recorded, opts.Fence),
		mem:      mem,
		lockFile: lf,
	}
	if opts.Shared && opts.DeferShare {
		ac := opts.sharedAccess()
		a.share = &ac
	}
	if opts.Lock {
		a.locked = lockMemory(mem, log)
	}
	log.Info("arena: opened", "path", path, "bytes", size, "locked", a.locked, "journal_entries", j.Len())
	if wait := time.Until(a.fence); wait > 0 {
		log.Info("arena kept from a crashed daemon: new regions wait until its clients' copies have ended", "for", wait.Round(time.Millisecond))
	}
	if !a.reused {
		// A new file: what an earlier daemon's clients wrote into went
		// with the old one, and so does its record of them.
		w.clear()
	} else if recorded {
		n, err := w.fenceLeft(a.alloc, opts.Fence)
		if err != nil {
			unix.Munmap(mem)
			return nil, err
		}
		if n > 0 {
			log.Info("arena kept from a crashed daemon: the regions its clients may still be copying into wait; the rest is free now",
				"regions", n, "for", opts.Fence)
		}
	}
	return a, nil
}

// prepareDir makes Dir ours, with the access asked for, and reports
// whether it created it. /dev/shm is world-writable, so a directory
// someone else created there, or a symlink planted in its place, must not
// become memory that trainers copy their weights into: those fail with
// ErrNotOurs.
func prepareDir(dir string, ac access) (bool, error) {
	if err := os.MkdirAll(filepath.Dir(dir), dirMode); err != nil {
		return false, fmt.Errorf("arena: create %s: %w", filepath.Dir(dir), err)
	}
	err := os.Mkdir(dir, dirMode)
	made := err == nil
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return false, fmt.Errorf("arena: create %s: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return made, fmt.Errorf("arena: %w", err)
	}
	if !fi.IsDir() {
		return made, fmt.Errorf("%w: %s is not a directory (%s)", ErrNotOurs, dir, fi.Mode().Type())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return made, fmt.Errorf("%w: %s is owned by uid %d, not by us (uid %d); refusing to use it",
			ErrNotOurs, dir, st.Uid, os.Geteuid())
	}
	return made, setAccess(dir, ac.dirMode, ac.gid)
}

// setAccess sets path's mode, and its group unless gid is -1. The group
// goes first, so the path is never group-readable by the wrong group.
func setAccess(path string, mode os.FileMode, gid int) error {
	if gid >= 0 {
		if err := os.Lchown(path, -1, gid); err != nil {
			return fmt.Errorf("arena: give %s to group %d: %w", path, gid, err)
		}
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("arena: %w", err)
	}
	return nil
}

// openArenaFile opens or creates the arena file (noting in made whether it
// created it) and makes sure its pages exist. It returns the size to map,
// which is want unless the journal says the existing file holds staged
// data.
func openArenaFile(path string, want int64, journaled int, ac access, made *created, log *slog.Logger) (*os.File, int64, error) {
	if journaled == 0 {
		// Nothing staged to keep: start from a new file. A client of a
		// crashed daemon still copying into its old mapping then writes
		// into the old, unlinked pages, never into regions this daemon
		// hands out.
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, 0, fmt.Errorf("arena: replace %s: %w", path, err)
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, privateMode)
	made.file = err == nil
	if errors.Is(err, fs.ErrExist) {
		f, err = os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("arena: open %s: %w", path, err)
	}
	size, err := chooseSize(f, want, journaled, log)
	if err == nil && ac.gid >= 0 {
		err = f.Chown(-1, ac.gid) // before the mode, as in setAccess
	}
	if err == nil {
		err = f.Chmod(ac.fileMode)
	}
	if have := fileSize(f); err == nil && size != have {
		if err = checkRoom(f, size-have); err == nil {
			err = f.Truncate(size) // its pages come with the mapping (populate)
		}
	}
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, size, nil
}

// checkRoom fails at once when f's file system has less than need bytes
// free: populating pages until it is full would take memory and time
// before failing, where fallocate refused a size larger than the file
// system outright.
func checkRoom(f *os.File, need int64) error {
	var st unix.Statfs_t
	if need <= 0 || unix.Fstatfs(int(f.Fd()), &st) != nil {
		return nil // populate is the backstop
	}
	if st.Bsize <= 0 || st.Bavail >= uint64((need+st.Bsize-1)/st.Bsize) {
		return nil
	}
	return fmt.Errorf("arena: allocate %d bytes for %s (is its file system big enough?): %d bytes free there",
		need, f.Name(), int64(st.Bavail)*st.Bsize) // fewer than need: no overflow
}

func fileSize(f *os.File) int64 {
	fi, err := f.Stat()
	if err != nil {
		return -1
	}
	return fi.Size()
}

func chooseSize(f *os.File, want int64, journaled int, log *slog.Logger) (int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("arena: %w", err)
	}
	have := fi.Size()
	switch {
	case have == want:
		return want, nil
	case have == 0:
		if journaled > 0 {
			log.Warn("arena: the arena file is new or empty but the journal holds entries; "+
				"the bytes they refer to are gone", "path", f.Name(), "journal_entries", journaled)
		}
		return want, nil
	case journaled == 0:
		log.Info("arena: resizing; the journal is empty so nothing staged is lost",
			"path", f.Name(), "old_bytes", have, "new_bytes", want)
		// Drop the old pages first so that tmpfs never holds both sizes.
		if err := f.Truncate(0); err != nil {
			return 0, fmt.Errorf("arena: truncate %s: %w", f.Name(), err)
		}
		return want, nil
	case have < pageSize:
		return 0, fmt.Errorf("arena: %s is only %d bytes but the journal holds %d entries",
			f.Name(), have, journaled)
	default:
		log.Warn("arena: keeping the existing arena size because its journal holds staged saves; "+
			"restart with the new size once they have drained",
			"path", f.Name(), "existing_bytes", have, "configured_bytes", want, "journal_entries", journaled)
		return have, nil
	}
}

// populate maps the arena's size bytes of f with every page allocated and
// mapped now: copying into cold tmpfs pages runs at well under 1 GB/s,
// into allocated ones at memory speed, and the copy is exactly the stall
// the trainer sees. One pass does both (MADV_POPULATE_WRITE), where
// fallocate and then a populated mapping walked every page twice (1.12x
// the time of writing each page once, against about 1.0x); a file system
// too small for it fails here, as fallocate did, instead of a SIGBUS
// later. Pages already there (an arena kept from a crash) keep their
// bytes. A kernel before 5.14 gets fallocate and MAP_POPULATE.
func populate(f *os.File, size int64) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("arena: mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	err = unix.Madvise(mem, unix.MADV_POPULATE_WRITE)
	if err == nil {
		return mem, nil
	}
	unix.Munmap(mem)
	if !errors.Is(err, unix.EINVAL) {
		return nil, fmt.Errorf("arena: allocate %d bytes for %s (is its file system big enough?): %w", size, f.Name(), err)
	}
	if err := preallocate(f, size); err != nil {
		return nil, err
	}
	mem, err = unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("arena: mmap %s (%d bytes): %w", f.Name(), size, err)
	}
	return mem, nil
}

// preallocate makes tmpfs allocate every page now (see populate).
func preallocate(f *os.File, size int64) error {
	err := unix.Fallocate(int(f.Fd()), 0, 0, size)
	if errors.Is(err, unix.EOPNOTSUPP) {
		err = f.Truncate(size)
	}
	if err != nil {
		return fmt.Errorf("arena: allocate %d bytes for %s (is its file system big enough?): %w",
			size, f.Name(), err)
	}
	return nil
}

// lockMemory reports whether mlock succeeded. A failure only costs
// performance (swapping, slower CUDA registration), so it is a warning.
func lockMemory(mem []byte, log *slog.Logger) bool {
	err := unix.Mlock(mem)
	if err == nil {
		return true
	}
	limit := "unknown"
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl) == nil {
		limit = "unlimited"
		if rl.Cur != unix.RLIM_INFINITY {
			limit = fmt.Sprintf("%d bytes", rl.Cur)
		}
	}
	log.Warn("arena: cannot lock the staging arena in memory; continuing unlocked "+
		"(it may be swapped, and CUDA pinning will be slower). Raise the limit with "+
		"`ulimit -l unlimited`, LimitMEMLOCK=infinity in the systemd unit, "+
		"or grant CAP_IPC_LOCK",
		"bytes", len(mem), "memlock_limit", limit, "err", err)
	return false
}

// ID identifies this opening of the arena file ("device:inode:nonce").
// Every lease carries it, and a client keeps the one GetArena gave with
// its mapping: a lease with another id means the daemon restarted (maybe
// with a new file at the same path, which bytes copied into the old
// mapping would never reach), and the client maps the arena again.
func (a *Arena) ID() string { return a.id }

// Path is the arena file that clients pass to Map.
func (a *Arena) Path() string { return a.path }

// Size is the arena's size in bytes; clients pass it to Map.
func (a *Arena) Size() int64 { return a.size }

// Bytes is the daemon's mapping of the whole arena. It is invalid after
// Close or Remove.
func (a *Arena) Bytes() []byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mem
}

// Reused reports whether the arena file is a crashed daemon's, kept for
// the saves its journal holds. That daemon's clients may still be copying
// into regions it had leased and never journaled, which this process sees
// as free: see staging.ManagerConfig.ReuseFence.
func (a *Arena) Reused() bool { return a.reused }

// Locked reports whether the arena is mlocked.
func (a *Arena) Locked() bool { return a.locked }

// Journal is the arena's journal of staged saves.
func (a *Arena) Journal() *Journal { return a.journal }

// fenceUntil is when a fenced arena (see Options.Fence) opens to Alloc.
func fenceUntil(reused bool, fence time.Duration) time.Time {
	if !reused {
		return time.Time{}
	}
	return time.Now().Add(fence)
}

// Alloc returns a free region of n bytes: 4 KiB aligned, 2 MiB aligned when
// n >= 2 MiB. When the arena is full it waits until enough is freed or ctx
// is done, then fails with an error wrapping ErrFull and ctx.Err().
func (a *Arena) Alloc(ctx context.Context, n int64) (Region, error) {
	if wait := time.Until(a.fence); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return Region{}, fmt.Errorf("%w: the arena is fenced for %s after a crash (--crash-fence): %w",
				ErrFull, wait.Round(time.Millisecond), ctx.Err())
		}
	}
	return a.alloc.alloc(ctx, n)
}

// Free returns a region obtained from Alloc or Reserve. Freeing anything
// else fails with ErrNotAllocated and changes nothing.
func (a *Arena) Free(r Region) error {
	a.writers.forget(r)
	return a.alloc.freeRegion(r)
}

// Reserve marks a specific region as used; on restart the daemon reserves
// the regions its journal names before handing out new ones.
func (a *Arena) Reserve(r Region) error {
	if a.writers.adopt(a.alloc, r) {
		return nil
	}
	return a.alloc.reserve(r)
}

// Used is the number of bytes allocated, counting whole pages.
func (a *Arena) Used() int64 { return a.alloc.usedBytes() }

// Available is the number of free bytes; fragmentation and alignment may
// keep a request of this size from fitting.
func (a *Arena) Available() int64 { return a.alloc.size - a.alloc.usedBytes() }

// Close unmaps the arena and releases the directory lock. The files stay:
// they are what a restarted daemon recovers from. Waiting Allocs fail with
// ErrClosed.
func (a *Arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.lockFile == nil {
		return nil
	}
	a.journal.close()
	return a.closeLocked(nil)
}

// Remove closes the arena and deletes its directory. It refuses, leaving
// the arena open, while the journal holds entries: those are acknowledged
// saves that are not durable yet.
func (a *Arena) Remove() error {
	return a.remove(func() error { return os.RemoveAll(a.dir) })
}

// Discard is Remove for a daemon whose start failed after Open: it deletes
// only what this Open created (the directory, or in a directory that was
// there before, the arena file, journal folder and lock file), so that a
// failed start leaves the place as it found it. While the journal holds
// entries it deletes nothing and only closes the arena.
func (a *Arena) Discard() error {
	err := a.remove(func() error { return undo(a.dir, a.made) })
	if errors.Is(err, ErrJournalNotEmpty) {
		return a.Close()
	}
	return err
}

func (a *Arena) remove(del func() error) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.lockFile == nil {
		return ErrClosed
	}
	// Checked and closed in one step so that no Put can slip in between.
	if n := a.journal.closeIfEmpty(); n > 0 {
		return fmt.Errorf("arena: remove %s: %w: %d staged saves not yet durable", a.dir, ErrJournalNotEmpty, n)
	}
	return a.closeLocked(del)
}

// undo deletes what one Open made in dir. The journal folder is removed
// only if empty and a directory made by that Open holds only what it put
// there.
func undo(dir string, made created) error {
	if made.dir {
		return os.RemoveAll(dir)
	}
	var err error
	rm := func(ok bool, name string) {
		if !ok {
			return
		}
		if e := os.Remove(filepath.Join(dir, name)); e != nil && !errors.Is(e, fs.ErrNotExist) {
			err = errors.Join(err, e)
		}
	}
	rm(made.file, arenaFile)
	rm(made.journal, journalDir)
	rm(made.writers, writersDir)
	rm(made.lock, lockFile)
	return err
}

func (a *Arena) closeLocked(del func() error) error {
	a.writers.close()
	a.alloc.close()
	err := unix.Munmap(a.mem)
	a.mem = nil
	if del != nil {
		// Still holding the lock, so a daemon starting now cannot have its
		// fresh arena deleted under it.
		err = errors.Join(err, del())
	}
	err = errors.Join(err, a.lockFile.Close())
	a.lockFile = nil
	return err
}

// fileID returns "device:inode" of an open file.
func fileID(f *os.File) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return "", fmt.Errorf("arena: stat %s: %w", f.Name(), err)
	}
	return fmt.Sprintf("%d:%d", st.Dev, st.Ino), nil
}

// Share opens an arena kept private by Options.DeferShare to its group,
// as Options.Shared would have at Open; it does nothing otherwise.
func (a *Arena) Share() error {
	if a.share == nil {
		return nil
	}
	if err := setAccess(a.dir, a.share.dirMode, a.share.gid); err != nil {
		return err
	}
	if err := setAccess(a.path, a.share.fileMode, a.share.gid); err != nil {
		return err
	}
	a.share = nil
	return nil
}
