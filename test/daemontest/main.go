// Package daemontest runs real `ckptd serve` processes for the end-to-end
// tests under test/: each on a unix socket in a temporary folder, with an
// arena of its own in /dev/shm, talked to with the Go client and the CLI.
//
// A test package's TestMain calls Main. Nothing a test run starts outlives
// it: daemons and helper processes get SIGKILL when the test binary dies
// (a timeout's panic, a kill -9), and a reaper process, which outlives the
// binary by design, removes every arena the run made once the binary is
// gone, however it went (internal/testreap).
package daemontest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ckptd/ckptd/internal/testreap"
)

// Attempt is the attempt (run of the job) every client of these tests
// saves under unless a test names another, as a launcher setting
// CKPTD_ATTEMPT for all ranks would.
const Attempt = "run1"

var arenaSeq atomic.Int64

// ArenaDir names a new arena folder of this test process (removed by the
// reaper if the process dies first).
func ArenaDir() string {
	return testreap.Prefix + strconv.FormatInt(arenaSeq.Add(1), 10)
}

// Main runs an end-to-end test package: it sets the attempt, runs the
// tests with a reaper watching (testreap) and removes what they built.
func Main(m *testing.M) {
	os.Setenv("CKPTD_ATTEMPT", Attempt)
	code := testreap.Run(m)
	for _, dir := range built {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// built are the temporary folders of binaries this process built.
var built []string

// Bin is the ckptd binary the daemons run: $CKPTD_TEST_RACE_BIN (make
// test builds it once for every package), else built here with the race
// detector.
func Bin(t testing.TB) string {
	t.Helper()
	return buildOnce(t, raceBin)
}

// PlainBin is ckptd built without the race detector, for tests that
// measure the daemon's memory as production would see it:
// $CKPTD_TEST_BIN, else built here.
func PlainBin(t testing.TB) string {
	t.Helper()
	return buildOnce(t, plainBin)
}

var (
	raceBin  = sync.OnceValues(func() (string, error) { return findOrBuild("CKPTD_TEST_RACE_BIN", "-race") })
	plainBin = sync.OnceValues(func() (string, error) { return findOrBuild("CKPTD_TEST_BIN") })
	buildMu  sync.Mutex
)

func buildOnce(t testing.TB, which func() (string, error)) string {
	t.Helper()
	bin, err := which()
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

func findOrBuild(env string, flags ...string) (string, error) {
	if bin := os.Getenv(env); bin != "" {
		return bin, nil
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	dir, err := os.MkdirTemp("", "ckptd-e2e-bin")
	if err != nil {
		return "", err
	}
	built = append(built, dir)
	bin := filepath.Join(dir, "ckptd")
	args := append(append([]string{"build"}, flags...), "-o", bin, "github.com/ckptd/ckptd/cmd/ckptd")
	if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return bin, nil
}
