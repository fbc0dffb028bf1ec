package daemon

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"

	"github.com/ckptd/ckptd/internal/arena"
)

// Where the arena lives when --arena-dir is not given.
//
// It must be found again by a daemon restarted after a crash (its journal
// holds acknowledged saves), and no other local user may be able to keep
// the daemon from starting, or make it use a folder they control, by
// creating that name first: /dev/shm is writable by everyone.
//
//   - The name is /dev/shm/ckptd-<uid>-<12 hex digits of sha256(socket
//     path)>: one per user and socket, so a restarted daemon on the same
//     socket finds it.
//   - If something that is not ours is there (another user's folder, a
//     symbolic link, a file), the daemon does not use it and does not fail:
//     it creates a fresh folder <that name>-<16 random hex digits>. Nobody
//     can have prepared that name, mkdir refuses one that exists, and the
//     sticky bit of /dev/shm keeps others from renaming or deleting it.
//     Its name goes into the pointer file <socket path>.arena, next to the
//     socket, which a restarted daemon reads first. That folder is private
//     to the daemon's user (the default socket folder is checked at start),
//     so nobody else can write or replace the pointer. A pointer is
//     followed only to a folder of the same family that exists and is ours;
//     otherwise it is ignored.
//   - If the socket's folder is not private (an explicit --socket in a
//     shared folder), a pointer there could be forged, so a taken name is
//     an error that names its owner and the fix (--arena-dir).
//   - A folder at the name used before (/dev/shm/ckptd-<hash>) that is ours
//     is still used, so that a daemon upgraded right after a crash drains
//     the old journal.

// shmDir is where default arenas go; tests point it elsewhere.
var shmDir = "/dev/shm"

// arenaPlace is where the arena was opened, and the pointer file that
// names it ("" if none does): write, when the daemon is up, if this start
// chose the name.
type arenaPlace struct {
	dir     string
	pointer string
	write   bool
}

// openArena opens the arena at --arena-dir, or at the default place
// described above.
func openArena(o *Options, sp *socketPlace, opts arena.Options, log *slog.Logger) (*arena.Arena, *arenaPlace, error) {
	if o.ArenaDir != "" {
		opts.Dir = o.ArenaDir
		a, err := arena.Open(opts)
		return a, &arenaPlace{dir: opts.Dir}, err
	}
	sum := sha256.Sum256([]byte(sp.path))
	hash := hex.EncodeToString(sum[:6])
	preferred := filepath.Join(shmDir, fmt.Sprintf("ckptd-%d-%s", os.Getuid(), hash))
	pointer := sp.path + ".arena"
	var candidates []string
	fromPointer := ""
	if sp.private {
		if d := readPointer(pointer, preferred+"-"); d != "" && ourDir(d) {
			fromPointer = d
			candidates = append(candidates, d)
		}
	}
	if legacy := filepath.Join(shmDir, "ckptd-"+hash); ourDir(legacy) {
		candidates = append(candidates, legacy)
	}
	candidates = append(candidates, preferred)
	var taken error
	for _, dir := range candidates {
		opts.Dir = dir
		a, err := arena.Open(opts)
		if err == nil {
			p := &arenaPlace{dir: dir}
			if dir == fromPointer {
				p.pointer = pointer
			}
			return a, p, nil
		}
		if !errors.Is(err, arena.ErrNotOurs) {
			return nil, nil, err
		}
		taken = err
	}
	if !sp.private {
		return nil, nil, fmt.Errorf("%w; the socket's folder %s is not private to this user, so ckptd cannot record "+
			"another name for the arena there: pass --arena-dir, or use a socket in a folder only you can write", taken, sp.dir)
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	opts.Dir = preferred + "-" + hex.EncodeToString(b[:])
	log.Warn("the default arena folder is taken by someone else; using a fresh name, recorded in the pointer file",
		"taken", taken, "arena", opts.Dir, "pointer", pointer)
	a, err := arena.Open(opts)
	if err != nil {
		return nil, nil, err
	}
	return a, &arenaPlace{dir: opts.Dir, pointer: pointer, write: true}, nil
}

// ourDir reports whether dir is a folder (not a symbolic link) of ours.
func ourDir(dir string) bool {
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && int(st.Uid) == os.Geteuid()
}

// readPointer returns the arena folder named in the pointer file, or "" if
// there is none we can trust: a regular file of ours naming a folder whose
// path starts with prefix and goes no deeper.
func readPointer(pointer, prefix string) string {
	fi, err := os.Lstat(pointer)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() > 4096 {
		return ""
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Geteuid() {
		return ""
	}
	b, err := os.ReadFile(pointer)
	if err != nil {
		return ""
	}
	dir := strings.TrimSpace(string(b))
	if !strings.HasPrefix(dir, prefix) || len(dir) == len(prefix) || filepath.Dir(dir) != filepath.Dir(prefix) ||
		filepath.Clean(dir) != dir {
		return ""
	}
	return dir
}

// writePointer records the arena folder in the pointer file, atomically.
func (p *arenaPlace) writePointer() error {
	if !p.write {
		return nil
	}
	tmp := p.pointer + ".tmp"
	if err := os.WriteFile(tmp, []byte(p.dir+"\n"), 0o600); err != nil {
		return fmt.Errorf("arena pointer: %w", err)
	}
	if err := os.Rename(tmp, p.pointer); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("arena pointer: %w", err)
	}
	return nil
}

// undoPointer deletes the pointer file if this start wrote it (its arena
// is new, so a failed start discards it). One that led this start to its
// arena stays, with the arena and its journal.
func (p *arenaPlace) undoPointer() {
	if p.write {
		p.removePointer()
	}
}

// removePointer deletes the pointer file once its arena is gone.
func (p *arenaPlace) removePointer() {
	if p.pointer == "" {
		return
	}
	if b, err := os.ReadFile(p.pointer); err == nil && strings.TrimSpace(string(b)) == p.dir {
		_ = os.Remove(p.pointer)
	}
}

// StaleArenaNames matches the names of this user's default arena folders
// (and the legacy ones, which carry no uid). An explicit --arena-dir is
// never reaped: it may be anything.
func StaleArenaNames() *regexp.Regexp {
	return regexp.MustCompile(fmt.Sprintf(`^ckptd-(%d-)?[0-9a-f]{12}(-[0-9a-f]{16})?$`, os.Getuid()))
}

// ShmDir is where default arenas are made.
func ShmDir() string { return shmDir }

// reapStale removes the arenas this user's dead daemons left in shmDir,
// so that the memory of a daemon killed on a node its job then left comes
// back at the next start of any daemon; those whose journal holds staged
// saves stay for a daemon on their socket to drain. Failures are logged:
// they must not stop this daemon.
func reapStale(own string, log *slog.Logger) {
	reaped, err := arena.ReapStale(arena.ReapOptions{Parent: shmDir, Names: StaleArenaNames(), Skip: own})
	if err != nil {
		log.Warn("could not remove every stale arena; ckptd cleanup retries", "err", err)
	}
	for _, st := range reaped {
		if st.Removed {
			log.Info("removed the arena of a daemon that is gone", "arena", st.Dir, "socket", st.Socket, "bytes", st.Bytes)
			continue
		}
		log.Warn("kept the arena of a daemon that is gone: its journal holds staged saves not yet in storage; "+
			"start ckptd serve on its socket to drain them (ckptd cleanup --force discards them)",
			"arena", st.Dir, "socket", st.Socket, "staged_saves", st.Journaled, "bytes", st.Bytes)
	}
}
