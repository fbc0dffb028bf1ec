// Package storagetest is the conformance suite every storage.Backend must
// pass, in the manner of restic's backend test suite. An implementation's
// tests call Run with a constructor for fresh, empty backends.
//
// The suite uses only the Backend interface, so it holds for any store (a
// directory, S3). It assumes nothing about where a backend keeps its bytes;
// checks of that kind (no temporary files left on disk) belong in the
// implementation's own tests.
package storagetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ckptd/ckptd/storage"
)

// Run runs the suite. newBackend must return a new, empty backend each time
// it is called; Run closes it when the subtest ends.
func Run(t *testing.T, newBackend func(t *testing.T) storage.Backend) {
	tests := []struct {
		name string
		fn   func(t *testing.T, b storage.Backend)
	}{
		{"PutGet", testPutGet},
		{"GetRange", testGetRange},
		{"SizeMismatch", testSizeMismatch},
		{"ReaderError", testReaderError},
		{"Overwrite", testOverwrite},
		{"OverwriteAtomic", testOverwriteAtomic},
		{"CancelBeforePut", testCancelBeforePut},
		{"CancelMidPut", testCancelMidPut},
		{"CancelOthers", testCancelOthers},
		{"PutIfAbsent", testPutIfAbsent},
		{"PutIfAbsentRace", testPutIfAbsentRace},
		{"PutIfAbsentAtomic", testPutIfAbsentAtomic},
		{"StatDelete", testStatDelete},
		{"NotFound", testNotFound},
		{"List", testList},
		{"ListInProgress", testListInProgress},
		{"Temporaries", testTemporaries},
		{"DeleteTemporaryMidPut", testDeleteTemporaryMidPut},
		{"ListStops", testListStops},
		{"ListDirs", testListDirs},
		{"ListDirsStops", testListDirsStops},
		{"InvalidNames", testInvalidNames},
		{"EdgeNames", testEdgeNames},
		{"ConcurrentPuts", testConcurrentPuts},
		{"ConcurrentPutDelete", testConcurrentPutDelete},
		{"Location", testLocation},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newBackend(t)
			t.Cleanup(func() {
				if err := b.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
			})
			tt.fn(t, b)
		})
	}
}

func testPutGet(t *testing.T, b storage.Backend) {
	const mib = 1 << 20
	tests := []struct {
		name      string
		size      int
		sizeKnown bool
	}{
		{"empty", 0, true},
		{"empty-unknown-size", 0, false},
		{"one-byte-unknown-size", 1, false},
		{"small", 4000, true},
		{"5MiB-odd", 5*mib + 123, true},
		{"9MiB-odd", 9*mib + 4097, true},
		{"9MiB-odd-unknown-size", 9*mib + 4097, false},
		{"12MiB", 12 * mib, true},
		{"12MiB-unknown-size", 12 * mib, false},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name := "putget/" + tt.name + "/obj"
			data := randomBytes(uint64(i), tt.size)
			size := int64(-1)
			if tt.sizeKnown {
				size = int64(len(data))
			}
			if err := b.Put(t.Context(), name, newChunkyReader(data), size); err != nil {
				t.Fatalf("Put: %v", err)
			}
			checkObject(t, b, name, data)
		})
	}
}

func testGetRange(t *testing.T, b storage.Backend) {
	const size = 100_000
	data := randomBytes(1, size)
	mustPut(t, b, "range/obj", data)
	tests := []struct {
		name           string
		offset, length int64
	}{
		{"all", 0, -1},
		{"head", 0, 10},
		{"middle", 1000, 5000},
		{"tail-to-end", 90_000, -1},
		{"exact-end", 90_000, 10_000},
		{"past-end", 99_900, 500},
		{"last-byte", size - 1, -1},
		{"zero-length", 50, 0},
		{"offset-at-end", size, -1},
		{"offset-beyond-end", size + 12345, 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := expectRange(data, tt.offset, tt.length)
			got := mustGet(t, b, "range/obj", tt.offset, tt.length)
			if !bytes.Equal(got, want) {
				t.Fatalf("Get(%d, %d) = %d bytes, want %d", tt.offset, tt.length, len(got), len(want))
			}
		})
	}
}

func expectRange(data []byte, offset, length int64) []byte {
	if offset >= int64(len(data)) {
		return nil
	}
	end := int64(len(data))
	if length >= 0 && offset+length < end {
		end = offset + length
	}
	return data[offset:end]
}

func testSizeMismatch(t *testing.T, b storage.Backend) {
	old := []byte("the old contents")
	mustPut(t, b, "size/existing", old)
	tests := []struct {
		name string
		data int
		size int64
	}{
		{"short", 5, 10},
		{"long", 10, 5},
		{"empty-but-announced", 0, 1},
		{"data-but-announced-empty", 1, 0},
		{"long-multi-block", 10 << 20, 9 << 20},
		{"short-multi-block", 9 << 20, 10 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := randomBytes(2, tt.data)
			err := b.Put(t.Context(), "size/new", newChunkyReader(data), tt.size)
			if err == nil {
				t.Fatalf("Put of %d bytes announced as %d: no error", tt.data, tt.size)
			}
			checkMissing(t, b, "size/new")
			err = b.Put(t.Context(), "size/existing", newChunkyReader(data), tt.size)
			if err == nil {
				t.Fatalf("Put over an object, %d bytes announced as %d: no error", tt.data, tt.size)
			}
			checkObject(t, b, "size/existing", old)
		})
	}
	checkList(t, b, "", []string{"size/existing"})
	checkNoTemporaries(t, b)
}

func testReaderError(t *testing.T, b storage.Backend) {
	boom := errors.New("reader failed")
	for _, size := range []int64{-1, 20 << 20} {
		r := io.MultiReader(bytes.NewReader(randomBytes(3, 9<<20)), errReader{boom})
		err := b.Put(t.Context(), "rerr/obj", r, size)
		if !errors.Is(err, boom) {
			t.Fatalf("Put with failing reader (size %d) = %v, want the reader's error", size, err)
		}
		checkMissing(t, b, "rerr/obj")
	}
	checkList(t, b, "", nil)
	checkNoTemporaries(t, b)
}

func testOverwrite(t *testing.T, b storage.Backend) {
	for i, size := range []int{1000, 10, 9<<20 + 1, 0, 5} {
		data := randomBytes(uint64(10+i), size)
		mustPut(t, b, "over/obj", data)
		checkObject(t, b, "over/obj", data)
	}
	checkList(t, b, "", []string{"over/obj"})
}

// testOverwriteAtomic checks that readers racing with overwrites see one
// version or the other, whole.
func testOverwriteAtomic(t *testing.T, b storage.Backend) {
	versions := [][]byte{randomBytes(20, 1<<20), randomBytes(21, 600<<10)}
	mustPut(t, b, "atomic/obj", versions[0])
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				got, err := get(t.Context(), b, "atomic/obj", 0, -1)
				if err != nil {
					t.Errorf("Get during overwrites: %v", err)
					return
				}
				if !bytes.Equal(got, versions[0]) && !bytes.Equal(got, versions[1]) {
					t.Errorf("reader saw %d bytes that are neither version", len(got))
					return
				}
			}
		})
	}
	for i := range 20 {
		mustPut(t, b, "atomic/obj", versions[i%2])
	}
	close(done)
	wg.Wait()
}

func testCancelBeforePut(t *testing.T, b storage.Backend) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	err := b.Put(ctx, "cancel/before", bytes.NewReader([]byte("x")), 1)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Put with cancelled ctx = %v, want context.Canceled", err)
	}
	err = b.PutIfAbsent(ctx, "cancel/before", []byte("x"))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("PutIfAbsent with cancelled ctx = %v, want context.Canceled", err)
	}
	checkList(t, b, "", nil)
}

// testCancelOthers: every call that takes a context fails with its error
// once it is cancelled, and changes nothing.
func testCancelOthers(t *testing.T, b storage.Backend) {
	mustPut(t, b, "cancel/obj", []byte("x"))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	check := func(op string, err error) {
		t.Helper()
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s with a cancelled context = %v, want context.Canceled", op, err)
		}
	}
	rc, err := b.Get(ctx, "cancel/obj", 0, -1)
	if err == nil {
		rc.Close()
	}
	check("Get", err)
	_, err = b.Stat(ctx, "cancel/obj")
	check("Stat", err)
	check("Delete", b.Delete(ctx, "cancel/obj"))
	checkObject(t, b, "cancel/obj", []byte("x"))
}

// cancelSlack is how many bytes a Put may read after its context is
// cancelled: backends check the context between blocks of at most this.
const cancelSlack = 64 << 20

func testCancelMidPut(t *testing.T, b storage.Backend) {
	old := []byte("old")
	mustPut(t, b, "cancel/existing", old)
	for _, name := range []string{"cancel/new", "cancel/existing"} {
		for _, size := range []int64{-1, 1 << 40} {
			t.Run(fmt.Sprintf("%s/size%d", name, size), func(t *testing.T) {
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				r := &cancellingReader{cancelAfter: 3 << 20, cancel: cancel}
				err := b.Put(ctx, name, r, size)
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("Put cancelled midway = %v, want context.Canceled", err)
				}
			})
		}
	}
	checkMissing(t, b, "cancel/new")
	checkObject(t, b, "cancel/existing", old)
	checkList(t, b, "", []string{"cancel/existing"})
	checkNoTemporaries(t, b)
}

// cancellingReader yields endless bytes and cancels the context after
// cancelAfter of them; it fails if it is read for long after that.
type cancellingReader struct {
	cancelAfter int64
	cancel      func()
	n           int64
}

func (r *cancellingReader) Read(p []byte) (int, error) {
	if r.n >= r.cancelAfter {
		r.cancel()
		if r.n-r.cancelAfter > cancelSlack {
			return 0, fmt.Errorf("read %d bytes after Put's context was cancelled", r.n-r.cancelAfter)
		}
	}
	r.n += int64(len(p))
	return len(p), nil
}

func testPutIfAbsent(t *testing.T, b storage.Backend) {
	ctx := t.Context()
	first, second := []byte("first"), []byte("second")
	if err := b.PutIfAbsent(ctx, "pia/obj", first); err != nil {
		t.Fatalf("PutIfAbsent on a new name: %v", err)
	}
	err := b.PutIfAbsent(ctx, "pia/obj", second)
	if !errors.Is(err, storage.ErrExists) {
		t.Fatalf("PutIfAbsent on an existing name = %v, want ErrExists", err)
	}
	checkObject(t, b, "pia/obj", first)

	mustPut(t, b, "pia/put", first)
	if err := b.PutIfAbsent(ctx, "pia/put", second); !errors.Is(err, storage.ErrExists) {
		t.Fatalf("PutIfAbsent after Put = %v, want ErrExists", err)
	}
	mustDelete(t, b, "pia/put")
	if err := b.PutIfAbsent(ctx, "pia/put", second); err != nil {
		t.Fatalf("PutIfAbsent after Delete: %v", err)
	}
	checkObject(t, b, "pia/put", second)

	big := randomBytes(30, 9<<20+7)
	if err := b.PutIfAbsent(ctx, "pia/big", big); err != nil {
		t.Fatalf("PutIfAbsent big: %v", err)
	}
	checkObject(t, b, "pia/big", big)
	if err := b.PutIfAbsent(ctx, "pia/empty", nil); err != nil {
		t.Fatalf("PutIfAbsent empty: %v", err)
	}
	checkObject(t, b, "pia/empty", nil)
	checkList(t, b, "", []string{"pia/big", "pia/empty", "pia/obj", "pia/put"})
}

func testPutIfAbsentRace(t *testing.T, b storage.Backend) {
	const racers = 16
	for round := range 5 {
		name := fmt.Sprintf("race/%d/COMMIT.json", round)
		start := make(chan struct{})
		errs := make([]error, racers)
		var wg sync.WaitGroup
		for i := range racers {
			wg.Go(func() {
				<-start
				errs[i] = b.PutIfAbsent(t.Context(), name, racerData(i))
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch {
			case err == nil && winner >= 0:
				t.Fatalf("round %d: racers %d and %d both won", round, winner, i)
			case err == nil:
				winner = i
			case !errors.Is(err, storage.ErrExists):
				t.Fatalf("round %d: racer %d: %v, want nil or ErrExists", round, i, err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: no racer won", round)
		}
		checkObject(t, b, name, racerData(winner))
	}
}

func racerData(i int) []byte { return fmt.Appendf(nil, `{"writer": %d}`, i) }

// testPutIfAbsentAtomic has readers poll a name while PutIfAbsent creates
// it: they must see no object or the whole of it, never a part.
func testPutIfAbsentAtomic(t *testing.T, b storage.Backend) {
	data := randomBytes(31, 4<<20+3)
	for round := range 3 {
		name := fmt.Sprintf("pia-atomic/%d/COMMIT.json", round)
		done := make(chan struct{})
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() {
				for {
					got, err := get(t.Context(), b, name, 0, -1)
					switch {
					case errors.Is(err, storage.ErrNotFound):
					case err != nil:
						t.Errorf("Get during PutIfAbsent: %v", err)
						return
					case !bytes.Equal(got, data):
						t.Errorf("reader saw %d bytes of the %d PutIfAbsent wrote", len(got), len(data))
						return
					}
					select {
					case <-done:
						return
					default:
					}
				}
			})
		}
		err := b.PutIfAbsent(t.Context(), name, data)
		close(done)
		wg.Wait()
		if err != nil {
			t.Fatalf("PutIfAbsent: %v", err)
		}
		checkObject(t, b, name, data)
	}
}

func testStatDelete(t *testing.T, b storage.Backend) {
	data := randomBytes(40, 1234)
	mustPut(t, b, "sd/a/b/obj", data)
	info, err := b.Stat(t.Context(), "sd/a/b/obj")
	if err != nil {
		t.Fatalf("Stat: %v", err)
	}
	if info.Name != "sd/a/b/obj" || info.Size != int64(len(data)) || info.ModTime.IsZero() {
		t.Fatalf("Stat = %+v, want name sd/a/b/obj, size %d, a modification time", info, len(data))
	}
	mustDelete(t, b, "sd/a/b/obj")
	checkMissing(t, b, "sd/a/b/obj")
	if err := b.Delete(t.Context(), "sd/a/b/obj"); err != nil {
		t.Fatalf("second Delete = %v, want nil (deleting a missing object succeeds)", err)
	}
	// The emptied "directories" are gone too, and can be used again.
	checkList(t, b, "", nil)
	mustPut(t, b, "sd/a/b/obj", data)
	checkObject(t, b, "sd/a/b/obj", data)
}

func testNotFound(t *testing.T, b storage.Backend) {
	mustPut(t, b, "nf/dir/obj", []byte("x"))
	// "nf/dir" and "nf" are prefixes of an object, not objects.
	for _, name := range []string{"nf/missing", "missing/deeper/obj", "nf/dir", "nf", "nf/dir/obj/below"} {
		t.Run(name, func(t *testing.T) {
			checkMissing(t, b, name)
			if err := b.Delete(t.Context(), name); err != nil {
				t.Fatalf("Delete(%q) = %v, want nil: deleting a missing object succeeds", name, err)
			}
			checkObject(t, b, "nf/dir/obj", []byte("x")) // and removes nothing else
		})
	}
	checkObject(t, b, "nf/dir/obj", []byte("x"))
}

func testList(t *testing.T, b storage.Backend) {
	// Chosen so that a directory walk in plain name order gets the order
	// wrong: '-' < '.' < '/' < '0'.
	names := []string{
		"l/A", "l/a b", "l/a-c", "l/a.b", "l/a/b", "l/a/c/d", "l/a0",
		"l/b/x", "l/ba", "l/c/.hidden", "m/z",
	}
	sizes := map[string]int64{}
	for i, n := range slices.Backward(names) { // insertion order must not matter
		data := randomBytes(uint64(50+i), i*10)
		mustPut(t, b, n, data)
		sizes[n] = int64(len(data))
	}
	want := func(prefix string) []string {
		var out []string
		for _, n := range names {
			if strings.HasPrefix(n, prefix) {
				out = append(out, n)
			}
		}
		return out
	}
	if got := listNames(t, b, "l/a"); !slices.Equal(got, []string{"l/a b", "l/a-c", "l/a.b", "l/a/b", "l/a/c/d", "l/a0"}) {
		t.Fatalf("List(l/a) = %q, not in lexical order", got)
	}
	for _, prefix := range []string{
		"", "l", "l/", "l/a", "l/a/", "l/a/c", "l/a/c/", "l/b", "l/ba", "l/a-c",
		"l/a-c/", "l/c/", "l/c/.", "l/zz", "zz/", "m/z/", "m/z", "n",
	} {
		checkList(t, b, prefix, want(prefix))
	}
	err := b.List(t.Context(), "", func(info storage.ObjectInfo) error {
		if info.Size != sizes[info.Name] || info.ModTime.IsZero() {
			t.Errorf("List gave %+v, want size %d and a modification time", info, sizes[info.Name])
		}
		return nil
	})
	if err != nil {
		t.Fatalf("List: %v", err)
	}
}

// startPut starts a Put of name from a pipe of unknown size: the test
// writes the object's bytes into pw (a write returns once Put has read
// them, so Put is midway then) and closes it, and the Put's result comes
// on the channel.
func startPut(t *testing.T, b storage.Backend, name string) (*io.PipeWriter, <-chan error) {
	pr, pw := io.Pipe()
	putErr := make(chan error, 1)
	go func() {
		err := b.Put(t.Context(), name, pr, -1)
		pr.CloseWithError(errors.New("the Put returned early")) // unblock the writer
		putErr <- err
	}()
	return pw, putErr
}

// testListInProgress checks that a Put in progress is not visible, nor
// the folder it is the first object of.
func testListInProgress(t *testing.T, b storage.Backend) {
	mustPut(t, b, "prog/done", []byte("done"))
	pw, putErr := startPut(t, b, "prog/new/busy")
	// Pipe writes return once Put has read the bytes, so Put is
	// midway when this returns.
	data := randomBytes(60, 9<<20)
	if _, err := pw.Write(data); err != nil {
		t.Fatalf("write to Put: %v", err)
	}
	checkList(t, b, "", []string{"prog/done"})
	checkMissing(t, b, "prog/new/busy")
	if got := listDirs(t, b, "prog/"); len(got) != 0 {
		t.Errorf("ListDirs(prog/) during the folder's first Put = %q, want nothing", got)
	}
	pw.Close()
	if err := <-putErr; err != nil {
		t.Fatalf("Put: %v", err)
	}
	checkObject(t, b, "prog/new/busy", data)
	checkList(t, b, "", []string{"prog/done", "prog/new/busy"})
	if got := listDirs(t, b, "prog/"); !slices.Equal(got, []string{"new"}) {
		t.Errorf("ListDirs(prog/) = %q, want [new]", got)
	}
}

// testTemporaries checks what ListTemporaries shows: nothing of a Put
// that returned, at most the Put's own temporary while it runs (a store
// whose Put keeps its bytes elsewhere until it publishes shows none), and
// a refusal of bad names.
func testTemporaries(t *testing.T, b storage.Backend) {
	checkNoTemporaries(t, b)
	for i, size := range []int{0, 4000, 9<<20 + 1, 12 << 20} {
		mustPut(t, b, fmt.Sprintf("temps/done/%d", i), randomBytes(uint64(70+i), size))
	}
	if err := b.PutIfAbsent(t.Context(), "temps/commit", []byte("{}")); err != nil {
		t.Fatal(err)
	}
	checkNoTemporaries(t, b)
	pw, putErr := startPut(t, b, "temps/new/busy")
	data := randomBytes(71, 9<<20)
	if _, err := pw.Write(data); err != nil { // Put has read the bytes once this returns
		t.Fatalf("write to Put: %v", err)
	}
	started := time.Now()
	temps := listTemporaries(t, b, "temps/")
	if len(temps) > 1 {
		t.Errorf("ListTemporaries during one Put = %+v, want at most its own", temps)
	}
	for _, tmp := range temps {
		if tmp.Name != "temps/new/busy" || tmp.ID == "" || tmp.Size < 0 || tmp.Size > int64(len(data)) {
			t.Errorf("the Put's temporary = %+v, want Name temps/new/busy, an ID and at most %d bytes", tmp, len(data))
		}
		if d := started.Sub(tmp.ModTime); d > time.Hour || d < -time.Hour {
			t.Errorf("the Put's temporary was last written at %v, %v from now", tmp.ModTime, d)
		}
	}
	if got := listTemporaries(t, b, "temps/new/busx"); len(got) != 0 {
		t.Errorf("ListTemporaries(temps/new/busx) = %+v, want none: no name matches", got)
	}
	if got := listTemporaries(t, b, "temps/new/bu"); len(got) != len(temps) {
		t.Errorf("ListTemporaries(temps/new/bu) = %+v, want %+v", got, temps)
	}
	checkList(t, b, "temps/new/", nil)
	pw.Close()
	if err := <-putErr; err != nil {
		t.Fatalf("Put: %v", err)
	}
	checkObject(t, b, "temps/new/busy", data)
	checkNoTemporaries(t, b)
	for _, prefix := range []string{"/abs", "a/../b", "a\x00b"} {
		if err := b.ListTemporaries(t.Context(), prefix, func(storage.Temporary) error { return nil }); !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("ListTemporaries(%q) = %v, want ErrInvalidName", prefix, err)
		}
	}
	for _, name := range []string{"", "/abs", "a/../b"} {
		if err := b.DeleteTemporary(t.Context(), storage.Temporary{Name: name, ID: "x"}); !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("DeleteTemporary of %q = %v, want ErrInvalidName", name, err)
		}
	}
	checkObject(t, b, "temps/new/busy", data)
}

// testDeleteTemporaryMidPut checks that deleting a Put's temporary while
// it runs makes that Put fail and store nothing (what a prune that
// mistook a stalled writer for a dead one does), that a second delete
// succeeds, and that the object of that name is never touched.
func testDeleteTemporaryMidPut(t *testing.T, b storage.Backend) {
	old := []byte("the old contents")
	mustPut(t, b, "tdel/obj", old)
	pw, putErr := startPut(t, b, "tdel/obj")
	if _, err := pw.Write(randomBytes(72, 9<<20)); err != nil {
		t.Fatalf("write to Put: %v", err)
	}
	temps := listTemporaries(t, b, "tdel/")
	for _, tmp := range temps {
		for range 2 {
			if err := b.DeleteTemporary(t.Context(), tmp); err != nil {
				t.Fatalf("DeleteTemporary(%+v): %v", tmp, err)
			}
		}
	}
	if got := listTemporaries(t, b, "tdel/"); len(got) != 0 {
		t.Errorf("temporaries after deleting them: %+v", got)
	}
	checkObject(t, b, "tdel/obj", old)
	_, _ = pw.Write(randomBytes(73, 6<<20)) // more parts, if the Put still reads
	pw.Close()
	err := <-putErr
	switch {
	case len(temps) > 0 && err == nil:
		t.Fatal("a Put whose temporary was deleted midway succeeded")
	case len(temps) == 0 && err != nil:
		t.Fatalf("Put: %v", err)
	case len(temps) > 0:
		checkObject(t, b, "tdel/obj", old)
	}
	checkNoTemporaries(t, b)
}

func testLocation(t *testing.T, b storage.Backend) {
	if b.Location() == "" {
		t.Error("Location() is empty; messages need to name the store")
	}
}

func testListStops(t *testing.T, b storage.Backend) {
	for _, n := range []string{"s/1", "s/2", "s/3/x", "s/4"} {
		mustPut(t, b, n, []byte(n))
	}
	stop := errors.New("stop here")
	var seen []string
	err := b.List(t.Context(), "s/", func(info storage.ObjectInfo) error {
		seen = append(seen, info.Name)
		if len(seen) == 2 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || !slices.Equal(seen, []string{"s/1", "s/2"}) {
		t.Fatalf("List stopped by fn = %v after %q, want fn's error after [s/1 s/2]", err, seen)
	}

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	err = b.List(ctx, "", func(storage.ObjectInfo) error { return nil })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("List with cancelled ctx = %v, want context.Canceled", err)
	}
}

func testListDirs(t *testing.T, b storage.Backend) {
	// "a-b/" sorts before "a/" ('-' < '/'), though "a" < "a-b".
	for _, n := range []string{
		"d/a/x", "d/a/y/z", "d/a-b/x", "d/a.b", "d/b/c/d/e", "d/.h/x", "d/file", "top",
	} {
		mustPut(t, b, n, []byte(n))
	}
	tests := []struct {
		dir  string
		want []string
	}{
		{"", []string{"d"}},
		{"d/", []string{".h", "a-b", "a", "b"}},
		{"d/a/", []string{"y"}},
		{"d/b/", []string{"c"}},
		{"d/b/c/d/", nil},
		{"d/missing/", nil},
		{"nothing/", nil},
	}
	for _, tt := range tests {
		if got := listDirs(t, b, tt.dir); !slices.Equal(got, tt.want) {
			t.Errorf("ListDirs(%q) = %q, want %q", tt.dir, got, tt.want)
		}
	}
	// A directory whose last object is deleted is no longer listed.
	mustDelete(t, b, "d/b/c/d/e")
	if got := listDirs(t, b, "d/"); !slices.Equal(got, []string{".h", "a-b", "a"}) {
		t.Errorf("ListDirs(d/) after deleting d/b's only object = %q", got)
	}
	for _, dir := range []string{"d", "/d/", "d//", "../", "d/../", "a\x00/"} {
		err := b.ListDirs(t.Context(), dir, func(string) error { return nil })
		if !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("ListDirs(%q) = %v, want ErrInvalidName", dir, err)
		}
	}
}

func testListDirsStops(t *testing.T, b storage.Backend) {
	for _, n := range []string{"s/1/x", "s/2/x", "s/3/x"} {
		mustPut(t, b, n, []byte(n))
	}
	stop := errors.New("stop here")
	var seen []string
	err := b.ListDirs(t.Context(), "s/", func(seg string) error {
		seen = append(seen, seg)
		return stop
	})
	if !errors.Is(err, stop) || !slices.Equal(seen, []string{"1"}) {
		t.Fatalf("ListDirs stopped by fn = %v after %q, want fn's error after [1]", err, seen)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	err = b.ListDirs(ctx, "s/", func(string) error { return nil })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("ListDirs with cancelled ctx = %v, want context.Canceled", err)
	}
}

// invalidNames are rejected by every backend, before touching storage.
var invalidNames = []string{
	"", "/abs", "/", "a/../b", "a//b", "./a", "a/.", ".", "..", "../a",
	"a/", "a\x00b", "a/" + strings.Repeat("s", 256) + "/b",
}

func testInvalidNames(t *testing.T, b storage.Backend) {
	ctx := t.Context()
	for _, name := range invalidNames {
		t.Run(fmt.Sprintf("%.30q", name), func(t *testing.T) {
			check := func(op string, err error) {
				t.Helper()
				if !errors.Is(err, storage.ErrInvalidName) {
					t.Errorf("%s(%q) = %v, want ErrInvalidName", op, name, err)
				}
			}
			check("Put", b.Put(ctx, name, bytes.NewReader([]byte("x")), 1))
			check("PutIfAbsent", b.PutIfAbsent(ctx, name, []byte("x")))
			_, err := b.Get(ctx, name, 0, -1)
			check("Get", err)
			_, err = b.Stat(ctx, name)
			check("Stat", err)
			check("Delete", b.Delete(ctx, name))
		})
	}
	for _, prefix := range []string{"/", "/abs", "a//", "../", "a/../b", "./", "a\x00"} {
		err := b.List(ctx, prefix, func(storage.ObjectInfo) error { return nil })
		if !errors.Is(err, storage.ErrInvalidName) {
			t.Errorf("List(%q) = %v, want ErrInvalidName", prefix, err)
		}
	}
	checkList(t, b, "", nil)
}

// testEdgeNames checks names that look odd but are valid.
func testEdgeNames(t *testing.T, b storage.Backend) {
	names := []string{
		"edge/back\\slash", "edge/.hidden", "edge/...", "edge/..x/y..",
		"edge/sp ace", "edge/ünïcode", "edge/" + strings.Repeat("m", storage.MaxSegmentLen),
	}
	for i, name := range names {
		data := randomBytes(uint64(70+i), 100+i)
		mustPut(t, b, name, data)
		checkObject(t, b, name, data)
	}
	slices.Sort(names)
	checkList(t, b, "edge/", names)
	for _, name := range names {
		mustDelete(t, b, name)
	}
	checkList(t, b, "", nil)
}

func testConcurrentPuts(t *testing.T, b storage.Backend) {
	const n = 16
	var wg sync.WaitGroup
	names := make([]string, n)
	for i := range n {
		names[i] = fmt.Sprintf("conc/d%d/obj-%02d", i%4, i)
		wg.Go(func() {
			data := randomBytes(uint64(100+i), i*37<<10+i)
			if err := b.Put(t.Context(), names[i], newChunkyReader(data), int64(len(data))); err != nil {
				t.Errorf("Put %s: %v", names[i], err)
			}
		})
	}
	wg.Wait()
	for i, name := range names {
		checkObject(t, b, name, randomBytes(uint64(100+i), i*37<<10+i))
	}
	slices.Sort(names)
	checkList(t, b, "conc/", names)
}

// testConcurrentPutDelete has writers share a "directory" that deleting
// the last object in it may remove.
func testConcurrentPutDelete(t *testing.T, b storage.Backend) {
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 25 {
				name := fmt.Sprintf("pd/shared/deep/w%d-%d", w, i)
				data := racerData(i)
				if err := b.Put(t.Context(), name, bytes.NewReader(data), int64(len(data))); err != nil {
					t.Errorf("Put %s: %v", name, err)
					return
				}
				if err := b.Delete(t.Context(), name); err != nil {
					t.Errorf("Delete %s: %v", name, err)
					return
				}
			}
		})
	}
	wg.Wait()
	checkList(t, b, "", nil)
}
