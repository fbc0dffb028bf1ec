package arena

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

func newJournal(t *testing.T) *Journal {
	t.Helper()
	j, _, err := openJournal(filepath.Join(t.TempDir(), "journal"))
	if err != nil {
		t.Fatal(err)
	}
	return j
}

func ids(entries []JournalEntry) []string {
	var out []string
	for _, e := range entries {
		out = append(out, e.ID)
	}
	return out
}

func mustList(t *testing.T, j *Journal) []JournalEntry {
	t.Helper()
	entries, err := j.List()
	if err != nil {
		t.Fatal(err)
	}
	return entries
}

func TestJournalPutListDelete(t *testing.T) {
	j := newJournal(t)
	if got := mustList(t, j); len(got) != 0 || j.Len() != 0 {
		t.Fatalf("new journal lists %v", got)
	}
	for _, id := range []string{"step-000000009000.rank-00001", "b", "A_1", "step-000000009000.rank-00000"} {
		if err := j.Put(id, []byte("data of "+id)); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.Put("b", []byte("replaced")); err != nil {
		t.Fatal(err)
	}
	got := mustList(t, j)
	want := []string{"A_1", "b", "step-000000009000.rank-00000", "step-000000009000.rank-00001"}
	if !slices.Equal(ids(got), want) || j.Len() != 4 {
		t.Fatalf("List ids = %v (Len %d), want %v", ids(got), j.Len(), want)
	}
	if string(got[1].Data) != "replaced" || string(got[0].Data) != "data of A_1" {
		t.Fatalf("data: %q %q", got[0].Data, got[1].Data)
	}

	if err := j.Delete("b"); err != nil {
		t.Fatal(err)
	}
	if err := j.Delete("b"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("second delete = %v, want fs.ErrNotExist", err)
	}
	if got := ids(mustList(t, j)); len(got) != 3 || slices.Contains(got, "b") || j.Len() != 3 {
		t.Fatalf("after delete: %v", got)
	}
}

func TestJournalIDs(t *testing.T) {
	tests := []struct {
		id string
		ok bool
	}{
		{"a", true},
		{"step-1.rank-0_x", true},
		{"a.", true},
		{strings.Repeat("x", 128), true},
		{"", false},
		{".hidden", false},
		{".", false},
		{"..", false},
		{".tmp-123", false},
		{"a/b", false},
		{"../x", false},
		{"a b", false},
		{"é", false},
		{"a\x00", false},
		{strings.Repeat("x", 129), false},
	}
	j := newJournal(t)
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%q", tt.id), func(t *testing.T) {
			if ValidID(tt.id) != tt.ok {
				t.Fatalf("ValidID = %v", !tt.ok)
			}
			err := j.Put(tt.id, []byte("x"))
			if tt.ok != (err == nil) || !tt.ok && !errors.Is(err, ErrInvalidID) {
				t.Fatalf("Put = %v", err)
			}
			if !tt.ok {
				if err := j.Delete(tt.id); !errors.Is(err, ErrInvalidID) {
					t.Fatalf("Delete = %v", err)
				}
			}
		})
	}
	if entries := mustList(t, j); len(entries) != 4 {
		t.Fatalf("listed %v", ids(entries))
	}
}

// A Put torn by a crash leaves only a temp file; it must never be listed,
// and it is cleaned up.
func TestJournalIgnoresTornWrites(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "journal")
	j, _, err := openJournal(dir)
	if err != nil {
		t.Fatal(err)
	}
	j.Put("whole", []byte("complete entry"))
	torn := filepath.Join(dir, tmpPrefix+"12345")
	os.WriteFile(torn, []byte("half an ent"), 0o600)
	os.WriteFile(filepath.Join(dir, "not valid"), []byte("?"), 0o600)
	os.Mkdir(filepath.Join(dir, "subdir"), 0o700)

	for _, open := range []bool{false, true} {
		if open { // a restarted daemon sees the same
			os.WriteFile(torn, []byte("half an ent"), 0o600)
			if j, _, err = openJournal(dir); err != nil {
				t.Fatal(err)
			}
		}
		got := mustList(t, j)
		if len(got) != 1 || got[0].ID != "whole" || string(got[0].Data) != "complete entry" || j.Len() != 1 {
			t.Fatalf("List = %v, Len %d", got, j.Len())
		}
		if _, err := os.Stat(torn); !os.IsNotExist(err) {
			t.Fatalf("torn write not cleaned: %v", err)
		}
	}
}

// Readers never see a partial entry, even while large entries are being
// rewritten.
func TestJournalConcurrentPutsAreAtomic(t *testing.T) {
	j := newJournal(t)
	const size = 256 << 10
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 20 {
				data := bytes.Repeat([]byte{byte(w*20 + i)}, size)
				if err := j.Put(fmt.Sprintf("w%d", w), data); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 50 {
			entries, err := j.List()
			if err != nil {
				t.Error(err)
				return
			}
			for _, e := range entries {
				if len(e.Data) != size || bytes.Count(e.Data, e.Data[:1]) != size {
					t.Errorf("entry %s is partial or mixed", e.ID)
				}
			}
		}
	}()
	wg.Wait()
	<-done
	if j.Len() != 4 {
		t.Fatalf("Len = %d", j.Len())
	}
}

func BenchmarkJournalPut(b *testing.B) {
	dir, err := os.MkdirTemp("/dev/shm", "ckptd-journal-bench-")
	if err != nil {
		b.Skip(err)
	}
	defer os.RemoveAll(dir)
	j, _, err := openJournal(dir)
	if err != nil {
		b.Fatal(err)
	}
	data := bytes.Repeat([]byte(`{"step":9000,"rank":1,"offset":4096,"length":1048576}`), 4)
	for b.Loop() {
		if err := j.Put("step-000000009000.rank-00001", data); err != nil {
			b.Fatal(err)
		}
	}
}
