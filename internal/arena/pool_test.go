package arena

import (
	"os"
	"path/filepath"
	"testing"
)

// A pool hands out page-aligned pieces of its file, knows them by
// offset, takes them back for reuse, and refuses what it cannot hold;
// Close removes the file.
func TestPool(t *testing.T) {
	dir := t.TempDir()
	p, err := OpenPool(dir, 4<<20-100) // rounded up to a page
	if err != nil {
		t.Fatal(err)
	}
	if p.Size() != 4<<20 || p.Path() != filepath.Join(dir, PoolFile) || p.ID() == "" {
		t.Fatalf("pool %s of %d bytes, id %q", p.Path(), p.Size(), p.ID())
	}
	if fi, err := os.Stat(p.Path()); err != nil || fi.Mode().Perm() != privateMode {
		t.Fatalf("pool file: %v %v", fi, err)
	}
	a, ok := p.Take(5000)
	if !ok || len(a) != 5000 || cap(a) != 5000 {
		t.Fatalf("take 5000: %v, len %d cap %d", ok, len(a), cap(a))
	}
	copy(a, "written through the daemon's mapping")
	off, ok := p.Offset(a)
	if !ok || off%pageSize != 0 {
		t.Fatalf("offset of a piece: %d %v", off, ok)
	}
	got := make([]byte, 36)
	f, err := os.Open(p.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(got, off); err != nil || string(got) != "written through the daemon's mapping" {
		t.Fatalf("the file at the piece's offset: %q %v", got, err)
	}
	if _, ok := p.Offset(make([]byte, 10)); ok {
		t.Fatal("heap memory taken for a piece of the pool")
	}
	if _, ok := p.Offset(a[:0]); !ok {
		t.Fatal("an empty view of a piece is not known") // its capacity still points into the pool
	}
	if b, ok := p.Take(0); !ok || cap(b) != 0 {
		t.Fatal("an empty piece")
	}
	if p.Fits(4<<20) || !p.Fits(2<<20) {
		t.Fatal("Fits disagrees with what is free")
	}
	if _, ok := p.Take(4 << 20); ok {
		t.Fatal("took more than is free")
	}
	p.Give(a)
	if !p.Fits(4 << 20) {
		t.Fatal("a piece given back is not free again")
	}
	whole, ok := p.Take(4 << 20)
	if !ok || len(whole) != 4<<20 {
		t.Fatal("the whole pool once free")
	}
	if _, ok := p.Take(-1); ok {
		t.Fatal("took a negative size")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p.Path()); !os.IsNotExist(err) {
		t.Fatalf("pool file after Close: %v", err)
	}
	if _, ok := p.Take(4096); ok {
		t.Fatal("took from a closed pool")
	}
	if err := p.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
}
