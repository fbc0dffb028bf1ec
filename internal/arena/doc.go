// Package arena owns the staging arena: the shared-memory file that trainers
// copy checkpoint shards into and that the daemon drains to storage, plus the
// small journal that remembers which staged regions are not yet durable.
//
// Layout of the arena directory (Options.Dir, normally on tmpfs, e.g.
// /dev/shm/ckptd-<id>):
//
//	Dir/           mode 0700, owned by the daemon's user: only it may map the arena
//	               (0750 and of group SharedGID when Options.Shared is set)
//	Dir/lock       flock(LOCK_EX) held by the daemon that owns the arena; holds its pid
//	Dir/arena      the staging memory, Size bytes, mode 0600 (0660 when shared), every page allocated and mapped up front
//	               and mapped MAP_SHARED by the daemon and by every client
//	Dir/journal/   one file per staged-but-not-yet-durable save, named by its id,
//	               content opaque to this package (the caller writes JSON);
//	               files named .tmp-* are torn writes and are ignored
//	Dir/writers/   one empty file per region a client may be writing into (a save's, from
//	               AllocWriter until Seal or Free), named <offset>-<length>: after a crash
//	               only those regions wait out Options.Fence
//	Dir/journal/quarantine/
//	               entries taken out of the journal because they cannot be replayed
//	               (Journal.Quarantine), as <time>-<id> with <time>-<id>.reason; the newest 64
//
// The arena file has no header: every byte belongs to the regions handed out by
// Alloc, so offsets the daemon hands to clients are plain file offsets. The
// allocator's state lives only in the daemon's memory; after a crash the
// daemon rebuilds it by calling Reserve for each region its journal names.
//
// Both the arena file and the journal live in tmpfs, so they survive a daemon
// crash (kill -9) but not a reboot. That is the guarantee "nothing
// acknowledged is lost" needs: a save is acknowledged once its journal entry
// is written, and a restarted daemon finds both the entry and the bytes.
// Close therefore never deletes anything; Remove does, and only when the
// journal is empty. Discard is for a start that fails after Open: it
// deletes only what that Open created.
//
// A daemon killed with SIGKILL keeps the lock until the kernel has torn
// down its memory, seconds for a large mlocked arena; Options.LockWait lets
// its successor wait for a holder that is exiting instead of failing.
//
// The package is Linux-only (MADV_POPULATE_WRITE or fallocate and
// MAP_POPULATE, flock).
package arena
