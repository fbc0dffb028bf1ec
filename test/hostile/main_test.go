package hostile

import (
	"os"
	"testing"

	"github.com/ckptd/ckptd/test/daemontest"
)

func TestMain(m *testing.M) {
	if act := os.Getenv("CKPTD_TEST_ACT"); act != "" { // a helper process of the trust and hostile tests
		runAct(act)
		os.Exit(0)
	}
	daemontest.Main(m)
}
