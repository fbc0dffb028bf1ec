package arena

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// JournalEntry is one journaled save: its id and the caller's encoding.
type JournalEntry struct {
	ID   string
	Data []byte
}

// Journal records staged saves that are not yet durable, one file per
// entry in a tmpfs directory next to the arena, so that they survive a
// daemon crash. Its only writer is the daemon holding the arena lock.
// All methods are safe for concurrent use.
type Journal struct {
	dir string

	mu          sync.Mutex
	ids         map[string]struct{}
	quarantined int // entries in quarantineDir
	closed      bool
}

const (
	// Temp files start with a dot, which no valid id does, so a torn write
	// can never be mistaken for an entry.
	tmpPrefix = ".tmp-"
	maxIDLen  = 128
)

// openJournal opens the journal in dir, creating dir if needed, and
// reports whether it did.
func openJournal(dir string) (*Journal, bool, error) {
	err := os.Mkdir(dir, dirMode)
	made := err == nil
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, false, fmt.Errorf("arena journal: %w", err)
	}
	j := &Journal{dir: dir}
	if _, err := j.scan(false); err != nil {
		return nil, made, err
	}
	n, err := pruneQuarantine(filepath.Join(dir, quarantineDir))
	if err != nil {
		return nil, made, fmt.Errorf("arena journal: %w", err)
	}
	j.quarantined = n
	return j, made, nil
}

// ValidID reports whether id can name a journal entry: 1 to 128 bytes of
// [A-Za-z0-9._-], not starting with a dot, and not "quarantine" (the
// folder of quarantined entries).
func ValidID(id string) bool {
	if id == "" || len(id) > maxIDLen || id[0] == '.' || id == quarantineDir {
		return false
	}
	for _, c := range []byte(id) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '.' || c == '_' || c == '-'
		if !ok {
			return false
		}
	}
	return true
}

func checkID(id string) error {
	if !ValidID(id) {
		return fmt.Errorf("%w: %q (want 1-%d bytes of [A-Za-z0-9._-], no leading dot, not %q)",
			ErrInvalidID, id, maxIDLen, quarantineDir)
	}
	return nil
}

// Put writes or replaces entry id. A crash mid-Put leaves either the old
// entry or the new one, never a partial one: the data goes to a temp file
// that is renamed into place. There is no fsync: on tmpfs it is a no-op,
// and the journal only has to survive the daemon, not the machine.
func (j *Journal) Put(id string, data []byte) error {
	return j.update("put", id, func() error {
		if err := j.write(id, data); err != nil {
			return err
		}
		j.ids[id] = struct{}{}
		return nil
	})
}

// update runs op on entry id under mu, once id is known to be valid and the
// journal open; op's error is wrapped with what and id.
func (j *Journal) update(what, id string, op func() error) error {
	if err := checkID(id); err != nil {
		return err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return ErrClosed
	}
	if err := op(); err != nil {
		return fmt.Errorf("arena journal: %s %q: %w", what, id, err)
	}
	return nil
}

func (j *Journal) write(id string, data []byte) error {
	return writeFileAtomic(filepath.Join(j.dir, id), data)
}

// Delete removes entry id; deleting a missing entry fails with an error
// matching fs.ErrNotExist.
func (j *Journal) Delete(id string) error {
	return j.update("delete", id, func() error {
		if err := os.Remove(filepath.Join(j.dir, id)); err != nil {
			return err
		}
		delete(j.ids, id)
		return nil
	})
}

// List returns every entry sorted by id. Leftover temp files from a crashed
// Put are skipped and deleted.
func (j *Journal) List() ([]JournalEntry, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return nil, ErrClosed
	}
	return j.scan(true)
}

// scan rebuilds the id set from the directory, optionally reading each
// entry. Callers hold mu or own j exclusively.
func (j *Journal) scan(read bool) ([]JournalEntry, error) {
	des, err := os.ReadDir(j.dir) // sorted by name, which is the id
	if err != nil {
		return nil, fmt.Errorf("arena journal: %w", err)
	}
	ids := make(map[string]struct{}, len(des))
	var entries []JournalEntry
	for _, de := range des {
		name := de.Name()
		if strings.HasPrefix(name, tmpPrefix) {
			// Under mu no Put is in flight, so this is a torn write.
			os.Remove(filepath.Join(j.dir, name))
			continue
		}
		if !de.Type().IsRegular() || !ValidID(name) {
			continue
		}
		if read {
			data, err := os.ReadFile(filepath.Join(j.dir, name))
			if errors.Is(err, fs.ErrNotExist) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("arena journal: %w", err)
			}
			entries = append(entries, JournalEntry{ID: name, Data: data})
		}
		ids[name] = struct{}{}
	}
	j.ids = ids
	return entries, nil
}

// Len is the number of entries.
func (j *Journal) Len() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.ids)
}

func (j *Journal) close() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.closed = true
}

// closeIfEmpty closes the journal if it has no entries and otherwise
// returns how many it has.
func (j *Journal) closeIfEmpty() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	if n := len(j.ids); n > 0 {
		return n
	}
	j.closed = true
	return 0
}
