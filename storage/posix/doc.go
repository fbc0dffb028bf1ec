// Package posix implements storage.Backend on a directory of a POSIX file
// system: a local disk, NFS, or a parallel file system such as Lustre.
//
// # Layout
//
// The object "a/b/c" is the regular file <root>/a/b/c; the slashes of a name
// become directories, created on demand and removed again by Delete when they
// become empty. Because a name is a path, one name cannot be both an object
// and a directory of other objects here ("a" and "a/b" cannot coexist); such
// a Put fails with the file system's error. Directories, and files that are
// neither regular nor links (FIFOs, devices), are not objects: Stat, Get and
// Delete report ErrNotFound for them and List skips them. Links are refused
// (see Links).
//
// While Put or PutIfAbsent runs, the bytes go to a temporary file next to the
// destination named
//
//	.<base>.tmp-<16 lowercase hex digits>
//
// where <base> is the last segment of the name, cut short if needed so the
// whole fits in 255 bytes. List never shows such files, and the backend
// rejects object names whose last segment has that form with
// storage.ErrInvalidName, so they cannot be confused with objects. A crash
// (a kill -9 of the writer) can leave one behind: ListTemporaries shows
// them all, under the object each would have become, with its size and
// last write (mtime), and DeleteTemporary removes one. Nothing in a name
// says whose it is (writers on several nodes may share the folder), so
// only its age can tell a dead writer's from a live one's.
//
// # Links
//
// The backend never follows a symbolic link below its root, so that a link
// planted in a shared store cannot make the daemon write, replace, read or
// delete a file outside it. Every path is resolved from a descriptor of the
// root opened once by New (a link in the root's own path is the operator's
// choice and is followed then), with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS) on Linux 5.6 and later and one openat(O_NOFOLLOW)
// per folder before that; the last segment is then handled relative to its
// folder with O_NOFOLLOW or AT_SYMLINK_NOFOLLOW. A link anywhere on the
// way, to a file or a folder, inside the root or outside, dangling or
// looping, fails Put, PutIfAbsent, Get, Stat and Delete with
// storage.ErrSymlink, naming the link; nothing is written or removed, the
// link included. List and ListDirs skip links.
//
// # Modes
//
// Objects are created with Options.FileMode (DefaultFileMode, 0640, unless
// set) and folders with the same bits plus search wherever read is allowed
// (0750), exactly: the umask does not apply. Checkpoints hold model
// weights and should not be world-readable on a shared file system. The
// root keeps its mode if it exists.
//
// # Durability and atomicity
//
// Put writes the temporary file, fsyncs it, renames it over the destination
// and fsyncs the folder (and the parent of every folder it created), so
// readers see the old object or the whole new one and the new one survives a
// crash once Put returns nil. PutIfAbsent does the same but publishes with
// link(2), or renameat2(RENAME_NOREPLACE) where the file system has no hard
// links; both fail atomically when the name exists, even between nodes
// sharing the file system, and neither ever shows a partial object. A file
// system with neither is refused with ErrNoAtomicCreate.
//
// # Direct I/O
//
// Large writes bypass the page cache with O_DIRECT where the file system
// allows it, so that streaming a checkpoint does not evict the page cache
// or pile up dirty pages that fsync must then flush. See Options.
package posix
