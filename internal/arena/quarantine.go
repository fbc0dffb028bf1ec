package arena

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// An entry that a daemon cannot replay (it no longer validates, or
// replaying it crashed the daemon) would otherwise be replayed on every
// start: a permanent crash loop. Quarantine moves it out of the journal
// into journal/quarantine/, named <UTC time>-<id>, with its reason in
// <UTC time>-<id>.reason, where List never sees it. Only the newest
// maxQuarantined are kept, so a recurring bug cannot fill the tmpfs.
const (
	quarantineDir  = "quarantine"
	reasonSuffix   = ".reason"
	maxQuarantined = 64
	// quarantineStamp sorts by time as text and never holds a '-'.
	quarantineStamp = "20060102T150405.000000000Z"
)

// Quarantine moves entry id out of the journal, so that it is never listed
// or replayed again, into the journal's quarantine folder with reason
// written next to it. Quarantining a missing entry fails with an error
// matching fs.ErrNotExist. The quarantine keeps the newest 64 entries and
// deletes older ones. Like the rest of the arena directory, it is deleted
// when the arena is removed.
func (j *Journal) Quarantine(id, reason string) error {
	return j.update("quarantine", id, func() error {
		if err := j.quarantine(id, reason); err != nil {
			return err
		}
		delete(j.ids, id)
		// The entry is out of the journal: that is what counts. A prune that
		// fails only keeps more than maxQuarantined until the next one.
		j.quarantined, _ = pruneQuarantine(filepath.Join(j.dir, quarantineDir))
		return nil
	})
}

func (j *Journal) quarantine(id, reason string) error {
	src := filepath.Join(j.dir, id)
	if _, err := os.Lstat(src); err != nil {
		return err
	}
	qdir := filepath.Join(j.dir, quarantineDir)
	if err := os.Mkdir(qdir, dirMode); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	var name string
	for t := time.Now(); ; t = t.Add(time.Nanosecond) { // one name per entry, even within a nanosecond
		name = filepath.Join(qdir, t.UTC().Format(quarantineStamp)+"-"+id)
		if _, err := os.Lstat(name); errors.Is(err, fs.ErrNotExist) {
			break
		}
	}
	// The reason first: a crash in between leaves a reason with no entry
	// (pruned in time), never an entry both in the journal and out of it.
	if err := writeFileAtomic(name+reasonSuffix, []byte(strings.TrimSpace(reason)+"\n")); err != nil {
		return err
	}
	if err := os.Rename(src, name); err != nil {
		os.Remove(name + reasonSuffix)
		return err
	}
	return nil
}

// Quarantined is the number of entries in the quarantine.
func (j *Journal) Quarantined() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.quarantined
}

// pruneQuarantine deletes all but the newest maxQuarantined entries of the
// quarantine folder qdir (with their reasons) and returns how many remain.
// A missing folder holds none.
func pruneQuarantine(qdir string) (int, error) {
	des, err := os.ReadDir(qdir)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	var keys []string // each entry once, whether its entry or its reason is left
	for _, de := range des {
		name := de.Name()
		if strings.HasPrefix(name, tmpPrefix) {
			os.Remove(filepath.Join(qdir, name)) // a torn reason
			continue
		}
		keys = append(keys, strings.TrimSuffix(name, reasonSuffix))
	}
	slices.Sort(keys)
	keys = slices.Compact(keys)
	for len(keys) > maxQuarantined {
		err = errors.Join(err, removeQuarantined(qdir, keys[0]))
		keys = keys[1:]
	}
	n := 0
	for _, key := range keys {
		if fi, e := os.Lstat(filepath.Join(qdir, key)); e == nil && fi.Mode().IsRegular() {
			n++
		}
	}
	return n, err
}

func removeQuarantined(qdir, key string) error {
	var err error
	for _, name := range []string{key, key + reasonSuffix} {
		if e := os.Remove(filepath.Join(qdir, name)); e != nil && !errors.Is(e, fs.ErrNotExist) {
			err = errors.Join(err, e)
		}
	}
	return err
}

// writeFileAtomic writes data to path through a temp file in its folder.
func writeFileAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), tmpPrefix+"*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	err = errors.Join(err, f.Close())
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
