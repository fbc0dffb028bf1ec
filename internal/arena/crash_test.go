package arena

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

const helperDirEnv = "CKPTD_ARENA_TEST_HELPER_DIR"

var crashPayload = bytes.Repeat([]byte("acknowledged "), 4096)

// TestHelperDaemon is the daemon side of TestSurvivesKill9, run in a child
// process: it stages a save, acknowledges it, and waits to be killed.
func TestHelperDaemon(t *testing.T) {
	dir := os.Getenv(helperDirEnv)
	if dir == "" {
		t.Skip("helper process only")
	}
	a, err := Open(Options{Dir: dir, Size: 4 * mib})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	r, err := a.Alloc(context.Background(), int64(len(crashPayload)))
	if err == nil {
		copy(a.Bytes()[r.Offset:], crashPayload)
		err = a.Journal().Put("save-1", fmt.Appendf(nil, "%d %d", r.Offset, r.Length))
	}
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("acknowledged")
	time.Sleep(time.Minute)
	os.Exit(1)
}

func TestSurvivesKill9(t *testing.T) {
	eachFS(t, func(t *testing.T, dir string) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDaemon$")
		cmd.Env = append(os.Environ(), helperDirEnv+"="+dir)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Process.Kill()
		line, _ := bufio.NewReader(out).ReadString('\n')
		if strings.TrimSpace(line) != "acknowledged" {
			t.Fatalf("helper said %q", line)
		}

		_, err = Open(Options{Dir: dir, Size: 4 * mib})
		if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), fmt.Sprint(cmd.Process.Pid)) {
			t.Fatalf("Open while the helper runs = %v, want ErrInUse naming pid %d", err, cmd.Process.Pid)
		}

		cmd.Process.Kill() // SIGKILL: no cleanup runs
		cmd.Wait()

		a := mustOpen(t, Options{Dir: dir, Size: 4 * mib})
		entries, err := a.Journal().List()
		if err != nil || len(entries) != 1 {
			t.Fatalf("journal after kill -9: %v, %v", entries, err)
		}
		var r Region
		if _, err := fmt.Sscanf(string(entries[0].Data), "%d %d", &r.Offset, &r.Length); err != nil {
			t.Fatal(err)
		}
		if err := a.Reserve(r); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a.Bytes()[r.Offset:r.Offset+r.Length], crashPayload) {
			t.Fatal("staged bytes lost in the crash")
		}
	})
}
