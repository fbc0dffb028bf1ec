//go:build linux

package ckptd

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
)

// The attempt a client's saves name: WithAttempt, else $CKPTD_ATTEMPT,
// else a random id per client; a bad one fails before anything is sent
// (the socket here has no daemon behind it).
func TestClientAttempt(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "none.sock")
	t.Setenv("CKPTD_ATTEMPT", "")
	a, err := Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	if len(a.Attempt()) != 16 || a.Attempt() == b.Attempt() {
		t.Errorf("random attempts %q and %q: want 16 hex digits each, different", a.Attempt(), b.Attempt())
	}
	t.Setenv("CKPTD_ATTEMPT", "slurm-42.1")
	if c, err := Dial(socket); err != nil || c.Attempt() != "slurm-42.1" {
		t.Errorf("attempt from the environment: %v, %v", c, err)
	}
	if c, err := Dial(socket, WithAttempt("run-2")); err != nil || c.Attempt() != "run-2" {
		t.Errorf("WithAttempt over the environment: %v, %v", c, err)
	}
	for _, bad := range []string{"Run", "../x", ".hidden", "a/b"} {
		if _, err := Dial(socket, WithAttempt(bad)); !errors.Is(err, ErrInvalid) {
			t.Errorf("Dial WithAttempt(%q): %v, want ErrInvalid", bad, err)
		}
		req := &SaveRequest{Step: 1, WorldSize: 1, Attempt: bad, Tensors: []Tensor{{Name: "x", DType: "U8", Shape: []int64{1}, Data: []byte{1}}}}
		for name, save := range map[string]func(context.Context, *SaveRequest) (*SaveHandle, error){"Save": a.Save, "SaveStream": a.SaveStream} {
			if _, err := save(t.Context(), req); !errors.Is(err, ErrInvalid) {
				t.Errorf("%s with attempt %q: %v, want ErrInvalid before any call", name, bad, err)
			}
		}
	}
}
