package arena

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"syscall"

	"golang.org/x/sys/unix"
)

// Stale is an arena folder whose daemon is gone: no process holds its
// lock. Its memory stays taken (tmpfs) until it is removed.
type Stale struct {
	Dir string
	// Socket is the dead daemon's socket, as its lock recorded it ("" for
	// a daemon that predates the record): a daemon started there again
	// finds this arena and drains its journal.
	Socket string
	// Journaled counts the staged saves its journal holds: acknowledged to
	// a trainer and not in storage yet.
	Journaled int
	// Bytes is the memory its files hold.
	Bytes int64
	// Removed says the folder was removed; one holding staged saves is
	// kept unless Force.
	Removed bool
}

// ReapOptions say which folders ReapStale looks at and what it removes.
type ReapOptions struct {
	// Parent is the folder arenas are made in (/dev/shm).
	Parent string
	// Names matches the folder names to look at: those the daemon gives
	// default arenas. An explicit --arena-dir is never touched.
	Names *regexp.Regexp
	// Skip is a folder to leave alone (the caller's own arena).
	Skip string
	// Force removes folders holding staged saves too, which loses them.
	Force bool
	// DryRun removes nothing.
	DryRun bool
}

// ReapStale finds this user's arena folders under opts.Parent whose lock
// no process holds and removes them, unless their journal holds staged
// saves (those drain when a daemon starts on that socket again). The
// lock, taken for the while, keeps a daemon starting on the same folder
// from using it until the folder is gone: it then makes a fresh one.
func ReapStale(opts ReapOptions) ([]Stale, error) {
	des, err := os.ReadDir(opts.Parent)
	if err != nil {
		return nil, fmt.Errorf("arena: look for stale arenas: %w", err)
	}
	var out []Stale
	var errs []error
	for _, de := range des {
		dir := filepath.Join(opts.Parent, de.Name())
		if !de.IsDir() || !opts.Names.MatchString(de.Name()) || dir == filepath.Clean(opts.Skip) || !ours(dir) {
			continue
		}
		st, ok, err := reapOne(dir, opts)
		if err != nil {
			errs = append(errs, err)
		}
		if ok {
			out = append(out, st)
		}
	}
	return out, errors.Join(errs...)
}

// ours reports whether dir is a folder, not a link, of this user.
func ours(dir string) bool {
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Geteuid()
}

// reapOne takes dir's lock if no process holds it; ok is false for a
// folder in use, being made, or not an arena.
func reapOne(dir string, opts ReapOptions) (st Stale, ok bool, err error) {
	path := filepath.Join(dir, lockFile)
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return Stale{}, false, nil // no lock yet: a daemon is making it, or it is not an arena
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil || !samePath(f, path) {
		return Stale{}, false, nil // held: a daemon runs (or is exiting); replaced: in use
	}
	_, socket := readLock(f)
	st = Stale{Dir: dir, Socket: socket, Journaled: countJournal(filepath.Join(dir, journalDir)), Bytes: folderBytes(dir)}
	if st.Journaled > 0 && !opts.Force || opts.DryRun {
		return st, true, nil
	}
	// Still under the lock: a daemon starting on this folder now waits,
	// then finds it gone and makes a new one.
	if err := os.RemoveAll(dir); err != nil {
		return st, true, fmt.Errorf("arena: remove the stale arena %s: %w", dir, err)
	}
	st.Removed = true
	return st, true, nil
}

// countJournal counts the entries of a journal folder without opening it
// as the journal (which would remove torn writes).
func countJournal(dir string) int {
	des, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	n := 0
	for _, de := range des {
		if de.Type().IsRegular() && ValidID(de.Name()) {
			n++
		}
	}
	return n
}

// folderBytes is the memory a tmpfs folder's files take (their blocks).
func folderBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, de fs.DirEntry, err error) error {
		if err != nil || de.IsDir() {
			return nil
		}
		if fi, err := de.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}
